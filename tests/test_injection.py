"""No code runs from spec or pyproject text.

Every text field that can reach generated source — the spec's name, description, param
names and string values, slot names, the spec's file name, the params of a
``[[tool.graphslot.outputs]]`` entry — gets payloads that would run code if emitted raw
(breaking out of the banner comment or the docstring with ``\\n``, ``\\r``, ``\\r\\n``,
quotes). Each must be refused or rendered inert, both when the registry is built in
process (``build_registry``, generated mode) and when the written module is imported.
Where spec validation refuses a payload, the generator is attacked directly with a spec
object carrying it, so the defence holds even when validation lets a string through.
"""

import ast
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import graphslot as gs
from graphslot.codegen.generator import (DOCSTRING, GeneratedCodeError, check_module_structure,
                                         render_module)
from graphslot.codegen.handshake import MODULE_FORMAT
from graphslot.codegen.inprocess import compile_module
from graphslot.codegen.layout import py_str
from graphslot.spec.project import ProjectConfigError

MARK = "GRAPHSLOT_INJECTION_RAN"
CODE = f"__import__('os').environ.__setitem__({MARK!r}, '1')"
PAYLOADS = {
    "newline": f"x\n{CODE}\n#",
    "cr": f"x\r{CODE}\r#",
    "crlf": f"x\r\n{CODE}\r\n#",
    "docstring": f'x"""\n{CODE}\n"""',
    "quote": f"x'\n{CODE}\n'",
    "formfeed": f"x\x0c\n{CODE}\n#",
    "separator": f"x\u2028{CODE}\u2029#",
    "bidi": f"x\u202e{CODE}",
    "one-line": f"x'; {CODE}; '",
}

BASE = {
    "name": "victim",
    "description": "plain",
    "params": {"mode": {"type": "str", "default": "a"}, "fill": {"type": "int", "default": 1, "runtime": True}},
    "slots": [{"name": "seq_lens", "shape": ["max_bs"], "dtype": "int64", "axis": "bs",
               "padding": "fill_sentinel", "pad_value": "fill"}],
}


@pytest.fixture(autouse=True)
def no_marker(monkeypatch):
    monkeypatch.delenv(MARK, raising=False)
    yield
    assert MARK not in os.environ, "a payload ran"


def _spec_text(field: str, payload: str) -> str:
    """The base spec (JSON is YAML) with ``payload`` in ``field``."""
    spec = json.loads(json.dumps(BASE))
    if field == "name":
        spec["name"] = payload
    elif field == "description":
        spec["description"] = payload
    elif field == "param name":
        spec["params"][payload] = {"type": "str", "default": "a"}
    elif field == "param value":
        spec["params"]["mode"]["default"] = payload
    elif field == "param description":
        spec["params"]["mode"]["description"] = payload
    elif field == "slot name":
        spec["slots"].append({"name": payload, "shape": [4], "dtype": "int32", "axis": "none"})
    return json.dumps(spec, indent=1)


def _assert_inert(text: str, payload: str) -> None:
    """Generated ``text`` that holds ``payload`` only as escaped literals."""
    assert "\r" not in text and CODE + "\n" not in text.replace("\\n", "")
    assert all(line == "" or not line.startswith(CODE) for line in text.split("\n"))
    assert all(c == "\n" or c.isprintable() for c in text)
    banner = text.split('"""', 1)[0].split("\n")[:-1]
    assert all(line.startswith("# ") and line.isascii() for line in banner), banner
    assert ast.get_docstring(ast.parse(text)) == DOCSTRING
    exec(compile(text, "<injection>", "exec"), {"__name__": "injection"})


FIELDS = ["name", "description", "param name", "param value", "param description", "slot name"]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_spec_text_never_runs_in_process(field, kind):
    payload = PAYLOADS[kind]
    try:
        spec = gs.parse_spec(_spec_text(field, payload), "victim.yaml")
        # generated mode: render, check, compile, exec
        reg = gs.build_registry(spec, max_bs=4, max_num_tokens=4, device="cpu")
    except gs.SpecError:
        return  # refused (by validation or by the structure check): fine, as long as nothing ran
    assert reg.impl == "generated"
    _assert_inert(render_module(spec, gs.resolve_params(spec)), payload)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@pytest.mark.parametrize("field", ["name", "description"])
def test_generator_escapes_text_validation_let_through(field, kind):
    """Validation may refuse these payloads; the generator must not rely on it."""
    payload = PAYLOADS[kind]
    spec = gs.parse_spec(_spec_text("name", "victim"), "victim.yaml")
    hostile = spec.model_copy(update={field: payload})
    assert getattr(hostile, field) == payload
    text = render_module(hostile, gs.resolve_params(spec))
    _assert_inert(text, payload)
    if field == "name":
        assert f"# spec:     {ascii(payload)}\n# identity: {hostile.identity}\n" in text
        assert f"SPEC_NAME = {py_str(payload)}\n" in text
    module = compile_module(hostile, gs.resolve_params(spec))
    assert module.SPEC_IDENTITY == hostile.identity  # its own module: the name is part of the identity


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_generator_escapes_hostile_param_values(kind):
    payload = PAYLOADS[kind]
    spec = gs.parse_spec(_spec_text("name", "victim"), "victim.yaml")
    params = gs.resolve_params(spec)
    params["mode"] = payload  # as if params validation had let it through
    text = render_module(spec, params)
    _assert_inert(text, payload)
    assert f"mode={ascii(payload)}" in text and f'"mode": {py_str(payload)}' in text


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_generator_escapes_hostile_file_names(kind):
    payload = PAYLOADS[kind]
    spec = gs.parse_spec(_spec_text("name", "victim"), payload + ".yaml")
    text = render_module(spec, gs.resolve_params(spec))  # the label defaults to spec.path
    _assert_inert(text, payload)
    assert f"from {ascii(payload + '.yaml')}. DO NOT EDIT." in text
    _assert_inert(render_module(spec, gs.resolve_params(spec), source_label=payload), payload)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_hostile_slot_and_runtime_param_names_reaching_the_emitter_are_refused(kind):
    """Names are placed as identifiers in code: one that is not an identifier must be
    refused before anything is compiled (the emitter owns the mangling, the generator
    the final check)."""
    payload = PAYLOADS[kind]
    spec = gs.parse_spec(_spec_text("name", "victim"), "victim.yaml")
    slot = spec.slots[0].model_copy(update={"name": payload})
    hostile = spec.model_copy(update={"slots": (slot,)})
    try:
        text = render_module(hostile, gs.resolve_params(spec))
    except GeneratedCodeError as exc:
        assert "refusing to generate code for spec 'victim'" in str(exc)
    except Exception:  # the emitter refusing on its own is fine too, if nothing ran
        pass
    else:
        _assert_inert(text, payload)


# --- the structural check ------------------------------------------------------------------


RUNTIME_IMPORT = "from graphslot.codegen import runtime as __gs_rt\n"
HANDSHAKE = f"__gs_rt.require(__name__, version={py_str(gs.__version__)}, format={MODULE_FORMAT})\n"
TORCH = "torch = __gs_rt.torch\n"
VIEW_MAKER = "__gs_ViewMaker = __gs_rt.ViewMaker\n"
KNOWN_HELPER = "expected `<helper> = __gs_rt.<helper>` of a known helper, found line"


def _good():
    spec = gs.parse_spec(_spec_text("name", "victim"), "victim.yaml")
    return spec, render_module(spec, gs.resolve_params(spec))


@pytest.mark.parametrize("edit, message", [
    # torch and the helpers: bound from the runtime, after the handshake, nothing else
    (lambda t: t.replace(TORCH, TORCH + "import os\n"), KNOWN_HELPER),
    (lambda t: t.replace(TORCH, "import torch\n"), "expected `torch = __gs_rt.torch`"),
    (lambda t: t.replace(TORCH, "torch = __gs_rt.os\n"), "expected `torch = __gs_rt.torch`"),
    (lambda t: t.replace(TORCH, "__gs_rt.torch = __import__('os')\n" + TORCH), "expected `torch = __gs_rt.torch`"),
    (lambda t: t.replace(VIEW_MAKER, VIEW_MAKER + "__gs_os = __gs_rt.os\n"), KNOWN_HELPER),
    (lambda t: t.replace(VIEW_MAKER, "__gs_ViewMaker = __gs_rt.allocate_buffer\n"), KNOWN_HELPER),
    (lambda t: t.replace(VIEW_MAKER, VIEW_MAKER + VIEW_MAKER), KNOWN_HELPER),
    (lambda t: t.replace(VIEW_MAKER, "__gs_ViewMaker = __import__('os').system\n"),
     "expected the constant SPEC_NAME = <its literal value>, found line"),
    (lambda t: t.replace(VIEW_MAKER, "from graphslot.codegen.runtime import ViewMaker as __gs_ViewMaker\n"),
     "expected the constant SPEC_NAME = <its literal value>, found line"),
    (lambda t: t.replace("\nSPEC_NAME =", "\n__import__('os')\nSPEC_NAME ="),
     "expected the constant SPEC_NAME = <its literal value>, found line"),
    (lambda t: t.replace('SPEC_NAME = "victim"', "SPEC_NAME = __import__('os').getcwd()"),
     "expected the constant SPEC_NAME"),
    (lambda t: t.replace('SPEC_NAME = "victim"', "SPEC_NAME = 'other'"), "expected the constant SPEC_NAME"),
    (lambda t: t.replace(f'"""{DOCSTRING}"""', '"""Something else."""'), "expected the module docstring"),
    (lambda t: t.replace("\ndef allocate(", "\n@print\ndef allocate("), "expected `def allocate(...)`"),
    (lambda t: t + "\n\ndef extra():\n    pass\n", "unexpected statement after `def bind`"),
    (lambda t: t + "\n__import__('os')\n", "unexpected statement after `def bind`"),
    (lambda t: t.replace("\n    return {\n", "\n    import os\n    return {\n", 1), "`Import` in `def allocate`"),
    (lambda t: t.replace("\n    plans = {}\n", "\n    plans = eval('{}')\n", 1), "the name 'eval' in `def bind`"),
    (lambda t: t.replace("\n    plans = {}\n", "\n    plans = ().__class__\n", 1),
     "the attribute '__class__' in `def bind`"),
    (lambda t: t.replace("# Regenerate with", "# x\rimport os\n# Regenerate with"), "control character '\\r'"),
    (lambda t: t.replace("\ndef allocate(", "\ndef allocate(("), "does not parse"),
    # the version handshake: first, exactly, with this module format
    (lambda t: t.replace(HANDSHAKE, ""), "expected the handshake `__gs_rt.require(__name__, version=..., format="),
    (lambda t: t.replace(HANDSHAKE, HANDSHAKE.replace("format=", "format=-1 + ")), "expected the handshake"),
    (lambda t: t.replace(HANDSHAKE, HANDSHAKE.replace(")\n", ", extra=__import__('os'))\n")),
     "expected the handshake"),
    (lambda t: t.replace(HANDSHAKE, HANDSHAKE.replace(")\n", ") or __import__('os')\n")), "expected the handshake"),
    (lambda t: t.replace(HANDSHAKE, HANDSHAKE.replace(f"format={MODULE_FORMAT}", "format=1")),
     "expected the handshake"),
    (lambda t: t.replace(RUNTIME_IMPORT, "from os import path as __gs_rt\n"),
     "expected `from graphslot.codegen import runtime as __gs_rt`"),
    (lambda t: t.replace(RUNTIME_IMPORT + "\n" + HANDSHAKE, "import torch\n" + RUNTIME_IMPORT + HANDSHAKE),
     "expected `from graphslot.codegen import runtime as __gs_rt`"),
    (lambda t: t.replace(HANDSHAKE, "import torch\n" + HANDSHAKE), "expected the handshake"),
])
def test_structure_check_refuses_anything_but_the_skeleton(edit, message):
    spec, text = _good()
    check_module_structure(text, spec)
    edited = edit(text)
    assert edited != text
    with pytest.raises(GeneratedCodeError) as info:
        check_module_structure(edited, spec)
    assert "refusing to generate code for spec 'victim'" in str(info.value)
    assert message in str(info.value), str(info.value)


def test_structure_check_holds_the_handshake_to_this_version():
    from graphslot.codegen import generator

    spec, text = _good()
    emission = generator.Emitter(spec, gs.resolve_params(spec), gs.__version__, spec.path).emit()
    expected = generator._expected_constants(spec, emission)
    check_module_structure(text, spec, expected)
    other = text.replace(HANDSHAKE, HANDSHAKE.replace(py_str(gs.__version__), '"0.0.1"'))
    assert other != text
    with pytest.raises(GeneratedCodeError, match="expected the handshake"):
        check_module_structure(other, spec, expected)


def test_structure_check_catches_a_template_regression(monkeypatch):
    """Were the banner to emit the name raw again, rendering fails instead of running it."""
    import graphslot.codegen.generator as generator

    monkeypatch.setattr(generator, "comment_text", str)
    spec, _ = _good()
    for payload in (PAYLOADS["newline"], PAYLOADS["cr"]):
        with pytest.raises(GeneratedCodeError, match="refusing to generate code"):
            render_module(spec.model_copy(update={"name": payload}), gs.resolve_params(spec))


def test_refused_module_is_an_error_build_registry_reports(monkeypatch):
    import graphslot.codegen.generator as generator

    monkeypatch.setattr(generator, "comment_text", str)
    spec = gs.parse_spec(_spec_text("name", "victim"), PAYLOADS["newline"] + ".yaml")
    with pytest.raises(gs.SpecError, match="not the expected skeleton|does not parse"):
        gs.build_registry(spec, max_bs=4, max_num_tokens=4, device="cpu")


# --- ahead of time: pyproject.toml and the written modules ------------------------------------


def _project(tmp_path: Path, spec_text: str, output: str) -> Path:
    (tmp_path / "specs").mkdir(exist_ok=True)
    (tmp_path / "specs" / "victim.yaml").write_text(spec_text, encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.graphslot]
        output_dir = "pkg/gen"

        [[tool.graphslot.outputs]]
        module = "victim_out"
        """) + output, encoding="utf-8")
    return tmp_path


def _generate_and_import(root: Path, monkeypatch, capsys) -> int:
    from graphslot.cli import main

    monkeypatch.chdir(root)
    status = main(["generate"])
    capsys.readouterr()
    written = root / "pkg" / "gen" / "victim_out.py"
    if written.exists():
        text = written.read_text(encoding="utf-8")
        assert all(c == "\n" or c.isprintable() for c in text)
        monkeypatch.syspath_prepend(str(root))
        saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "pkg" or m.startswith("pkg.")}
        importlib.invalidate_caches()
        try:
            importlib.import_module("pkg.gen.victim_out")
        finally:  # leave no package named pkg from this temporary project behind
            for m in [m for m in sys.modules if m == "pkg" or m.startswith("pkg.")]:
                del sys.modules[m]
            sys.modules.update(saved)
    return status


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string (escapes included)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("kind", ["newline", "cr", "docstring", "one-line"])
def test_written_modules_never_run_spec_text(tmp_path, monkeypatch, capsys, field, kind):
    root = _project(tmp_path, _spec_text(field, PAYLOADS[kind]), 'spec = "specs/victim.yaml"\n')
    _generate_and_import(root, monkeypatch, capsys)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_pyproject_param_strings_never_run(tmp_path, monkeypatch, capsys, kind):
    output = f'spec = "specs/victim.yaml"\nparams = {{ mode = {_toml(PAYLOADS[kind])} }}\n'
    root = _project(tmp_path, _spec_text("name", "victim"), output)
    status = _generate_and_import(root, monkeypatch, capsys)
    if kind == "one-line":  # no control characters: accepted, and inert
        assert status == 0
        text = (root / "pkg" / "gen" / "victim_out.py").read_text()
        assert f"mode={ascii(PAYLOADS[kind])}" in text
    else:
        assert status == 1


def test_pyproject_param_string_with_newline_is_an_error_with_its_line(tmp_path, monkeypatch, capsys):
    from graphslot.cli import main

    output = f'spec = "specs/victim.yaml"\nparams = {{ mode = {_toml(PAYLOADS["newline"])} }}\n'
    monkeypatch.chdir(_project(tmp_path, _spec_text("name", "victim"), output))
    assert main(["generate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pyproject.toml:7: [[tool.graphslot.outputs]] entry 1 params: mode = "), err
    assert "contains control characters" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["newline", "cr", "docstring"])
def test_pyproject_param_names_and_spec_paths_never_run(tmp_path, monkeypatch, capsys, kind):
    payload = PAYLOADS[kind]
    output = f'spec = "specs/victim.yaml"\nparams = {{ {_toml(payload)} = "a" }}\n'
    root = _project(tmp_path, _spec_text("name", "victim"), output)
    assert _generate_and_import(root, monkeypatch, capsys) == 1
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [tool.graphslot]
        output_dir = "pkg/gen"

        [[tool.graphslot.outputs]]
        module = "victim_out"
        spec = {_toml("specs/" + payload)}
        """))
    assert _generate_and_import(root, monkeypatch, capsys) == 1


def test_spec_file_name_is_escaped_in_the_written_banner(tmp_path, monkeypatch, capsys):
    name = "it's a \"spec\" (1).yaml"
    root = _project(tmp_path, _spec_text("name", "victim"), f"spec = {_toml('specs/' + name)}\n")
    (root / "specs" / "victim.yaml").rename(root / "specs" / name)
    assert _generate_and_import(root, monkeypatch, capsys) == 0
    text = (root / "pkg" / "gen" / "victim_out.py").read_text()
    assert f"from {ascii('specs/' + name)}. DO NOT EDIT." in text


def test_pyproject_errors_are_project_config_errors():
    assert issubclass(ProjectConfigError, ValueError)


def test_cli_refuses_a_module_that_fails_the_structure_check(tmp_path, monkeypatch, capsys):
    """Defence in depth: were escaping to regress, `graphslot generate` would refuse to
    write (exit 1, `file: message`, no traceback) rather than write a payload."""
    import graphslot.codegen.generator as generator
    from graphslot.cli import main

    # Validation refuses line breaks in names, so the regression is simulated where the
    # escaping happens: every comment lets a statement through.
    monkeypatch.setattr(generator, "comment_text", lambda value: f"{value}\nimport os\n#")
    root = _project(tmp_path, _spec_text("name", "victim"), 'spec = "specs/victim.yaml"\n')
    monkeypatch.chdir(root)
    for argv in (["generate"], ["generate", "--check"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert err.startswith("specs/victim.yaml: refusing to generate code for spec "), err
        assert "Traceback" not in out + err
    assert not (root / "pkg").exists()
