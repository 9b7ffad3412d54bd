"""Mutated shipped specs and pyproject tables: every answer is a result or a located error.

Spec files arrive in pull requests, so whatever text a mutation of ``decode.yaml`` or
``prefill.yaml`` makes -- lines dropped, doubled, re-indented or cut, values swapped for
hostile tokens -- parsing either returns a spec or raises ``SpecError`` whose every
issue names the file and a line; never another exception. A mutant that validates
renders a module that passes the skeleton check and compiles, and builds in both modes
with the same buffers (or, naming a hook nobody registered, fails the build at its line).
Likewise a mutated ``[tool.graphslot]`` table: ``validate`` and ``generate --check``
answer with messages and an exit status, never a traceback, and write nothing.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphslot as gs
from graphslot.codegen.generator import render_module
from graphslot.spec.loading import spec_path

SOURCES = {name: spec_path(name).read_text() for name in ("decode", "prefill")}

# Values a mutation writes after a key's colon: other types, broken expressions, YAML
# features the loader refuses, huge and odd numbers, code, and names that exist.
TOKENS = [
    "", "[]", "{}", "[1, [2]]", "{a: 1}", "null", "~", "true", "no", "0", "-1", "1.5", "1e400", ".inf", ".nan",
    "0x10", "99999999999999999999999", "'x'", "\"\\u2028\"", "!!python/object:os.system", "*anchor", "&anchor 1",
    "<<: {}", "max_bs", "max_bs * max_num_tokens", "max_bs // 0", "max_bs ** 99", "(((((1)))))", "1 +",
    "__import__('os')", "lambda: 0", "int64", "bfloat16", "float8", "tokens", "bs", "none", "zero",
    "fill_sentinel", "keep_pad", "cpu", "seq_len_fill_value", "builtin:copy", "os:system", "a.b", "x" * 300,
    "é\u202e", "- item", "| block", "'unterminated",
]

YAML_VALUE = re.compile(r"^(\s*(?:- )?[A-Za-z_][A-Za-z0-9_]*:)\s*\S.*$")  # `key: value`, `- key: value`


def mutations(kinds, tokens, max_size):
    """Lists of (what, where in the file as a fraction, token)."""
    where = st.floats(min_value=0.0, max_value=1.0, exclude_max=True)
    return st.lists(st.tuples(st.sampled_from(kinds), where, st.sampled_from(tokens)), min_size=1, max_size=max_size)


def mutate(text: str, edits, value=YAML_VALUE) -> str:
    """``text`` with each mutation applied in turn; "value" replaces what ``value``'s
    first group is followed by."""
    lines = text.splitlines()
    for kind, where, token in edits:
        if not lines:
            break
        i = int(where * len(lines))
        line = lines[i]
        if kind == "drop":
            del lines[i]
        elif kind == "double":
            lines.insert(i, line)
        elif kind == "indent":
            lines[i] = "  " + line
        elif kind == "dedent":
            lines[i] = line[2:] if line.startswith("  ") else line
        elif kind == "value":
            match = value.match(line)
            lines[i] = f"{match.group(1)} {token}" if match else f"{line} {token}"
        elif kind == "cut":
            lines[i] = line[: len(line) // 2]
            del lines[i + 1:]
        else:
            lines.insert(i, token)
    return "\n".join(lines) + "\n"


def parse_or_issues(text: str, source: str):
    """The spec, or the issues of the ``SpecError``; any other exception fails the test."""
    try:
        return gs.parse_spec(text, path=source), []
    except gs.SpecError as exc:
        return None, exc.issues


def test_mutate_changes_what_it_says():
    text = "name: x\nslots:\n  - name: a\n    shape: [max_bs]\n"
    assert mutate(text, [("value", 0.0, "[]")]) == "name: []\nslots:\n  - name: a\n    shape: [max_bs]\n"
    assert mutate(text, [("drop", 0.5, "")]) == "name: x\nslots:\n    shape: [max_bs]\n"
    assert mutate(text, [("cut", 0.75, "")]) == "name: x\nslots:\n  - name: a\n    shape\n"


@pytest.mark.parametrize("name", sorted(SOURCES))
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=mutations(["drop", "double", "indent", "dedent", "value", "cut", "insert"], TOKENS, 4))
def test_a_mutated_spec_is_a_spec_or_a_located_error(name, edits):
    source = f"{name}.yaml"
    text = mutate(SOURCES[name], edits)
    spec, issues = parse_or_issues(text, source)
    for issue in issues:
        assert issue.file == source, str(issue)
        assert issue.line is not None and 1 <= issue.line <= text.count("\n") + 1, str(issue)
        assert "\n" not in str(issue) and len(str(issue)) < 1000, str(issue)
    if spec is None:
        return
    try:
        params = gs.resolve_params(spec, torch_dtypes=False)
    except gs.SpecError as exc:  # a param value the spec's own checks refuse
        assert all(i.file == source for i in exc.issues), str(exc)
        return
    module = render_module(spec, params)  # a validated spec always renders: no GeneratedCodeError
    compile(module, source, "exec")
    try:
        built = {mode: gs.build_registry(spec, max_bs=4, max_num_tokens=8, device="cpu", impl=mode)
                 for mode in ("interpreted", "generated")}
    except gs.SpecError as exc:  # a cut hook name: validation cannot know the engine's hooks
        assert all(i.file == source and i.line and "hook" in i.message for i in exc.issues), str(exc)
        return
    slots = {mode: {s.name: s.buffer for s in reg.active} for mode, reg in built.items()}
    assert slots["interpreted"].keys() == slots["generated"].keys()
    for slot, buffer in slots["interpreted"].items():
        assert torch.equal(buffer, slots["generated"][slot]), slot


# --- [tool.graphslot] in pyproject.toml is untrusted too ------------------------------------

PYPROJECT = """\
[project]
name = "engine"

[tool.graphslot]
specs = ["specs/decode.yaml"]
output_dir = "engine/generated"
import_hooks = false

[[tool.graphslot.outputs]]
module = "decode_default"
spec = "specs/decode.yaml"

[[tool.graphslot.outputs]]
module = "decode_eager"
spec = "specs/decode.yaml"
preset = "eager"
params = {cache_loc_dtype = "int32"}
"""

TOML_TOKENS = [
    '""', '"../outside"', '"/etc"', '"specs/../../x.yaml"', '"specs/nope.yaml"', '"specs/decode.yaml"', "[]",
    "[1, 2]", '["a", 1]', "{}", "{a = 1}", "true", "1", "-1", "1e400", "nan", '"decode_default"', '"a.b"',
    '"import"', '"os"', '"__init__"', '"eager"', '"missing"', '"\\u0000"', '"\\u202e"', '"x"', '"',
    "[[tool.graphslot.outputs]]", "[tool.graphslot]", '"' + "y" * 300 + '"',
]
TOML_VALUE = re.compile(r"^(\s*[A-Za-z_][A-Za-z0-9_]*\s*=)\s*\S.*$")  # `key = value`


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "specs").mkdir()
    (root / "specs" / "decode.yaml").write_text(SOURCES["decode"])
    return root


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(edits=mutations(["drop", "double", "value", "cut", "insert"], TOML_TOKENS, 3))
def test_a_mutated_pyproject_gets_messages_and_nothing_written(project, capsys, edits):
    from graphslot.cli.app import main

    (project / "pyproject.toml").write_text(mutate(PYPROJECT, edits, TOML_VALUE))
    before = listing(project)
    cwd = os.getcwd()
    os.chdir(project)
    try:
        statuses = [main(["validate"]), main(["generate", "--check"])]
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert statuses != [0, 0] or not err.strip(), err
    assert set(statuses) <= {0, 1, 2} and "Traceback" not in err, err
    for line in err.splitlines():  # a problem in the table names its line there
        assert line.strip() and not re.match(r"(graphslot \w+: error: )?pyproject\.toml:(?!\d+: )", line), line
    assert listing(project) == before  # --check writes nothing, whatever the table says
