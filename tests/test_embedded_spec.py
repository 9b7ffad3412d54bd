"""A generated module runs on its own (issue 25): it carries its spec (SPEC_SOURCE,
SPEC_JSON: the canonical form SPEC_IDENTITY hashes, as escaped string literals), so
``build_registry(module)`` works from any working directory without the YAML; the
embedded spec is data, never code, and a module of another spec says which file each
came from and what to do."""

from __future__ import annotations

import ast
import difflib
import hashlib
import io
import json
import re
import tokenize
from collections import Counter
from pathlib import Path

import pytest

import graphslot as gs
from graphslot.codegen.embedded import canonical_parts, module_spec
from graphslot.codegen.generator import GeneratedCodeError, check_module_structure, render_module

from conftest import LORA_IDS_SLOT

REPO = Path(__file__).resolve().parent.parent
GENERATED = REPO / "graphslot" / "generated"


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """A working directory with no spec, no project; and no spec file may be read."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def no_reading(*args, **kwargs):
        raise AssertionError(f"a spec file was read: {args}")

    import graphslot.api
    monkeypatch.setattr(graphslot.api, "load_spec", no_reading)
    return elsewhere


def _edited_decode() -> gs.RegistrySpec:
    """The shipped decode spec with one slot added, as a project's specs/decode.yaml."""
    text = (REPO / "graphslot" / "slot_specs" / "decode.yaml").read_text()
    return gs.parse_spec(text + LORA_IDS_SLOT, "specs/decode.yaml")


def test_the_committed_module_builds_a_registry_without_its_yaml(import_text, nowhere):
    module = import_text("decode_default", (GENERATED / "decode_default.py").read_text())
    reg = gs.build_registry(module, max_bs=8, max_num_tokens=8, device="cpu")
    assert reg.module is module and reg.impl == "generated"
    assert reg.spec.path == "graphslot/slot_specs/decode.yaml (embedded in gs_tmp_pkg.decode_default)"
    assert reg.spec.identity == module.SPEC_IDENTITY
    assert [s.name for s in reg.active] == list(module.SLOTS)


def test_a_module_of_a_preset_runs_with_its_own_params(import_text, nowhere):
    module = import_text("decode_eager", (GENERATED / "decode_eager.py").read_text())
    assert (gs.build_registry(module, max_bs=8, max_num_tokens=8, device="cpu").params["dp_size"]
            == module.PARAMS["dp_size"])
    # a runtime param: no regeneration
    runtime = gs.build_registry(module, max_bs=8, max_num_tokens=8, params={"seq_len_fill_value": 7}, device="cpu")
    assert runtime.params["seq_len_fill_value"] == 7
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(module, max_bs=8, max_num_tokens=8, params={"dp_size": 2, "require_gathered_buffer": True},
                          device="cpu")
    assert "generated module 'gs_tmp_pkg.decode_eager' was generated for other params: dp_size (module: 1, " \
           "registry: 2), require_gathered_buffer (module: False, registry: True); declare an output with these " \
           "params and run `graphslot generate`" in str(info.value)


def test_the_embedded_spec_is_the_canonical_form_its_identity_hashes():
    for path in sorted(p for p in GENERATED.glob("*.py") if p.name != "__init__.py"):
        namespace = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and node.targets[0].id in ("SPEC_IDENTITY", "SPEC_JSON"):
                namespace[node.targets[0].id] = ast.literal_eval(node.value)
        assert hashlib.sha256(namespace["SPEC_JSON"].encode("ascii")).hexdigest() == namespace["SPEC_IDENTITY"]


def _embedded_lines(text: str) -> list:
    lines = text.splitlines()
    start = lines.index("SPEC_JSON = (")
    return lines[start + 1:lines.index(")", start)]


def test_the_embedded_spec_starts_a_line_for_each_param_and_slot():
    spec = _edited_decode()
    assert "".join(canonical_parts(spec)) == spec.canonical_json()
    literals = _embedded_lines(render_module(spec, gs.resolve_params(spec), "specs/decode.yaml"))
    assert all(len(line) <= 88 and line.startswith("    ") for line in literals)
    slot_starts = [line for line in literals if re.match(r"    ',?\{\"(adopt|axis)\":", line)]
    assert len(slot_starts) == len(spec.slots)
    assert len([line for line in literals if '":{"default":' in line]) == len(spec.params)


@pytest.mark.parametrize("where", ["end", "middle"])
def test_adding_a_slot_adds_the_lines_of_its_embedded_spec_and_changes_no_other(where):
    """The embedded spec is data, outside the names property of tests/test_stable_names.py:
    its diff for a slot added is lines added, together that slot's JSON, none removed."""
    shipped = (REPO / "graphslot" / "slot_specs" / "decode.yaml").read_text()
    marker = "  - name: seq_lens\n"
    edited = shipped + LORA_IDS_SLOT if where == "end" else shipped.replace(marker, LORA_IDS_SLOT + marker)
    old, new = (gs.parse_spec(text, "specs/decode.yaml") for text in (shipped, edited))
    before, after = (_embedded_lines(render_module(s, gs.resolve_params(s), "specs/decode.yaml")) for s in (old, new))
    diff = list(difflib.unified_diff(before, after, n=0, lineterm=""))[2:]
    assert not [line for line in diff if line.startswith("-")]
    starts = [i for i, line in enumerate(after) if re.match(r"    ',?\{\"(adopt|axis)\":", line)] + [len(after) - 1]
    first = max(i for i in starts if i <= next(i for i, line in enumerate(after) if '"name":"lora_ids"' in line))
    group = after[first:starts[starts.index(first) + 1]]  # the lines of the new slot's JSON
    assert json.loads("".join(ast.literal_eval(line.strip()) for line in group).lstrip(",")) == \
        new.canonical()["slots"][[s.name for s in new.slots].index("lora_ids")]
    assert Counter(after) - Counter(before) == Counter(group) and len(after) == len(before) + len(group)


def test_a_damaged_embedded_spec_is_refused(import_text, nowhere):
    text = (GENERATED / "decode_default.py").read_text()
    assert text.count('"dtype":"int32"') >= 1
    module = import_text("decode_damaged", text.replace('"dtype":"int32"', '"dtype":"int64"', 1))
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(module, max_bs=8, max_num_tokens=8, device="cpu")
    assert str(info.value) == (
        "graphslot/slot_specs/decode.yaml (embedded in gs_tmp_pkg.decode_damaged): generated module "
        "'gs_tmp_pkg.decode_damaged' carries a spec that is not the one its SPEC_IDENTITY names; the module "
        "was edited or damaged: regenerate it (graphslot generate)")


def test_build_registry_names_what_a_spec_may_be():
    with pytest.raises(TypeError) as info:
        gs.build_registry(42, max_bs=8, max_num_tokens=8, device="cpu")
    assert str(info.value) == ("build_registry: spec must be a RegistrySpec, a spec name or path, or a generated "
                               "module, got int")


def test_a_module_of_a_project_spec_given_the_shipped_spec_names_both_files_and_the_fix(import_text, nowhere):
    """The project's module (its decode spec has a slot more) against graphslot's shipped
    decode spec, as `build_registry("decode", mode=module)` outside the project gets it:
    the message names the module's file and the shipped one, and the right fix."""
    spec = _edited_decode()
    module = import_text("decode_project", render_module(spec, gs.resolve_params(spec), "specs/decode.yaml"))
    shipped = gs.parse_spec((REPO / "graphslot" / "slot_specs" / "decode.yaml").read_text(),
                            str(REPO / "graphslot" / "slot_specs" / "decode.yaml"))
    with pytest.raises(gs.SpecError) as info:
        gs.build_registry(shipped, max_bs=8, max_num_tokens=8, impl=module, device="cpu")
    assert str(info.value) == (
        f"{shipped.path}: generated module 'gs_tmp_pkg.decode_project' was generated from specs/decode.yaml "
        f"(identity {spec.identity[:12]}…), this registry's spec is graphslot's shipped spec {shipped.path} "
        f"(identity {shipped.identity[:12]}…): build the registry from the module's own spec -- "
        "build_registry(module) uses the spec embedded in it -- or pass the spec file it was generated from")
    reg = gs.build_registry(module, max_bs=8, max_num_tokens=8, device="cpu")  # the fix
    assert "lora_ids" in [s.name for s in reg.active]


# --- the embedded spec is data, never code -----------------------------------------------------

MARK = "GRAPHSLOT_EMBEDDED_INJECTION_RAN"
CODE = f"__import__('os').environ.__setitem__({MARK!r}, '1')"
PAYLOADS = [f"x\n{CODE}\n#", f"x'''\n{CODE}\n'''", f'x"""{CODE}"""', f"x\\'); {CODE}; ('", f'x\\"); {CODE}; ("',
            f"x\\\\'; {CODE}; '", f"x\u2028{CODE}", "x\\u0027); " + CODE]


def _hostile_spec(payload: str) -> gs.RegistrySpec:
    """A valid spec whose free strings (a str param's default, a preset's value, a preset
    name) hold ``payload``, and whose slot reads a runtime param in its pad value."""
    spec = gs.parse_spec("name: victim\nparams:\n  mode: {type: str, default: a}\n"
                         "  fill: {type: int, default: 1, runtime: true}\n"
                         "slots:\n  - {name: seq_lens, shape: [max_bs], dtype: int64, axis: bs, "
                         "padding: fill_sentinel, pad_value: fill}\n", "victim.yaml")
    mode = spec.params["mode"].model_copy(update={"default": payload})
    return spec.model_copy(update={"params": {**spec.params, "mode": mode}, "presets": {payload: {"mode": payload}}})


def _strings_only(text: str, payload_code: str) -> None:
    """``payload_code`` occurs in ``text`` inside string literals and comments only."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.STRING, tokenize.COMMENT):
            assert payload_code not in token.string and "environ" not in token.string, token


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_hostile_spec_text_reaches_the_embedded_spec_only_as_literals(payload, import_text, monkeypatch):
    monkeypatch.delenv(MARK, raising=False)
    spec = _hostile_spec(payload)
    text = render_module(spec, gs.resolve_params(spec), "victim.yaml")
    _strings_only(text, CODE)
    module = import_text("victim", text)
    assert module.SPEC_JSON == spec.canonical_json()
    if payload.isprintable():
        assert module_spec(module).presets == {payload: {"mode": payload}}
        assert module_spec(module).identity == spec.identity
    else:  # read back, the embedded spec is validated as a spec file is: no control characters
        with pytest.raises(gs.SpecError, match=r"victim.yaml \(embedded in gs_tmp_pkg.victim\): default of "
                                               "param 'mode' contains the control character U"):
            module_spec(module)
    assert MARK not in __import__("os").environ


@pytest.mark.parametrize("value", ["__import__('os').getcwd()", "'{}'.format(1)", "SPEC_IDENTITY",
                                   "('{\"name\":\"victim\"' + '}')"])
def test_the_embedded_spec_may_only_be_string_literals(value):
    spec = _hostile_spec("a")
    text = render_module(spec, gs.resolve_params(spec), "victim.yaml")
    start = text.index("SPEC_JSON = ")
    end = text.index("\n\n", start)
    edited = text[:start] + f"SPEC_JSON = {value}" + text[end:]
    with pytest.raises(GeneratedCodeError, match="expected the constant SPEC_JSON = <its literal value>"):
        check_module_structure(edited, spec)


@pytest.mark.parametrize("groups, expected", [
    (["{\"a\":1,", "\"b\":2}"], ['SPEC_JSON = \'{"a":1,"b":2}\'']),                                  # fits the line
    (['{"name":"' + "d" * 24 + '",', '"' + "a" * 37 + '":1}'],                                 # a group a line
     ["SPEC_JSON = (", "    '{\"name\":\"" + "d" * 24 + '",\'', "    '\"" + "a" * 37 + "\":1}'", ")"]),
    (["{" + "b" * 90 + ",", "c}"],                                                              # cut to fit
     ["SPEC_JSON = (", '    "{' + "b" * 81 + '"', '    "' + "b" * 9 + ',"', '    "c}"', ")"]),
])
def test_the_embedded_spec_literal_starts_a_line_for_each_group_and_fits_88_columns(groups, expected):
    from graphslot.codegen.layout import concatenated

    lines = concatenated("SPEC_JSON", groups)
    assert lines == expected
    text = "\n".join(lines) + "\n"
    assert ast.literal_eval(ast.parse(text).body[0].value) == "".join(groups)
