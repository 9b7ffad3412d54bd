"""``[tool.graphslot]`` is validated as strictly as a spec: every unknown key or wrong
type is a ``pyproject.toml:LINE: message`` error (exit 1 from the command line, never a
traceback)."""

import textwrap
import tomllib

import pytest

from graphslot.cli import main
from graphslot.spec.project import ProjectConfigError, load_project_config
from graphslot.spec.pyproject_text import MAX_PYPROJECT_BYTES

SPEC = textwrap.dedent("""
    name: tiny
    slots:
      - {name: seq_lens, shape: [max_bs], dtype: int64, axis: bs, padding: zero}
""")

OUTPUT = '\n[[tool.graphslot.outputs]]\nmodule = "tiny_default"\nspec = "specs/tiny.yaml"\n'


def _write(tmp_path, text):
    (tmp_path / "specs").mkdir(exist_ok=True)
    (tmp_path / "specs" / "tiny.yaml").write_text(SPEC)
    (tmp_path / "pyproject.toml").write_text(text)
    return tmp_path


def _errors(tmp_path, text):
    _write(tmp_path, text)
    with pytest.raises(ProjectConfigError) as info:
        load_project_config(tmp_path)
    return [str(i) for i in info.value.issues]


@pytest.mark.parametrize("text, expected", [
    ('[tool.graphslot]\nspec = ["specs/tiny.yaml"]\n',
     "pyproject.toml:2: [tool.graphslot]: unknown key 'spec'; did you mean 'specs'? "
     "(allowed: import_hooks, output_dir, outputs, specs)"),
    ('[tool.graphslot]\nspecs = []\noutputdir = "gen"\n',
     "pyproject.toml:3: [tool.graphslot]: unknown key 'outputdir'; did you mean 'output_dir'? "
     "(allowed: import_hooks, output_dir, outputs, specs)"),
    ('[tool.graphslot]\nspec = 5\n',
     "pyproject.toml:2: [tool.graphslot]: unknown key 'spec'; did you mean 'specs'? "
     "(allowed: import_hooks, output_dir, outputs, specs)"),
    ('[tool.graphslot]\nspecs = 5\n', "pyproject.toml:2: [tool.graphslot] specs must be a list of paths "
                                      "(strings), got 5"),
    ('[tool.graphslot]\n\noutput_dir = 5\n', "pyproject.toml:3: [tool.graphslot] output_dir must be a path "
                                             "(a string), got an integer"),
    ('[tool.graphslot]\noutput_dir = "/tmp/gen"\n', "pyproject.toml:2: [tool.graphslot] output_dir '/tmp/gen' "
                                                    "is absolute; it must be relative to the directory of "
                                                    "pyproject.toml"),
    ('[tool.graphslot]\noutput_dir = "C:\\\\gen"\n', "pyproject.toml:2: [tool.graphslot] output_dir 'C:\\\\gen' "
                                                     "is absolute; it must be relative to the directory of "
                                                     "pyproject.toml"),
    ('[tool.graphslot]\noutput_dir = ""\n', "pyproject.toml:2: [tool.graphslot] output_dir must not be empty"),
    ('[tool.graphslot]\nspecs = ["specs/tiny.yaml", "a\\u202eb.yaml"]\n',  # names the path, as output_dir does
     "pyproject.toml:2: [tool.graphslot] specs: 'a\\u202eb.yaml' contains control characters"),
    ('[tool.graphslot]\nimport_hooks = "yes"\n',
     "pyproject.toml:2: [tool.graphslot] import_hooks must be true or false, got a string"),
    ('[tool.graphslot]\noutputs = 3\n', "pyproject.toml:2: [tool.graphslot] outputs must be an array of "
                                        "tables ([[tool.graphslot.outputs]] entries), got an integer"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspec = "s"\nparams = 3\n',
     "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1 params must be a table such as { dp_size = 2 }, "
     "got an integer"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspec = "s"\n'
     'preset = ["eager"]\n',
     "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1: preset must be a non-empty string, got an array"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspec = 5\n',
     "pyproject.toml:6: [[tool.graphslot.outputs]] entry 1: spec must be a non-empty string, got an integer"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspecs = "s"\n',
     "pyproject.toml:6: [[tool.graphslot.outputs]] entry 1: unknown key 'specs'; did you mean 'spec'? "
     "(allowed: module, params, preset, spec)"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\n',
     "pyproject.toml:4: [[tool.graphslot.outputs]] entry 1: needs 'module' and 'spec' keys (missing: spec)"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspec = "s"\n'
     'params = { dp_size = [1, 2] }\n',
     "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1 params: dp_size must be a scalar (boolean, number "
     "or string), got an array"),
    ('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "a"\nspec = "s"\n\n'
     '[[tool.graphslot.outputs]]\nmodule = "a"\nspec = "t"\n',
     "pyproject.toml:4: [tool.graphslot] outputs: module name used twice: a"),
    ('[tool]\ngraphslot = 3\n', "pyproject.toml: [tool.graphslot] must be a table, got an integer"),
    ('[tool.graphslot\n', "pyproject.toml:1: not valid TOML: Expected ']' at the end of a table declaration"),
])
def test_config_errors_name_the_line(tmp_path, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    assert expected in _errors(tmp_path, text)


@pytest.mark.parametrize("module, message", [
    ("a-b", "module 'a-b' must be a Python identifier (letters, digits, _)"),
    ("class", "module 'class' is a Python keyword"),
    ("__init__", "module '__init__' is a dunder name (such as __init__), which graphslot does not generate"),
    ("__main__", "module '__main__' is a dunder name"),
    ("x\\nimport os", "module 'x\\nimport os' must be a Python identifier"),
    ("caf\\u00e9", "module 'caf\\xe9' must be a Python identifier"),
    ("", "module '' must be a Python identifier"),
])
def test_module_names(tmp_path, monkeypatch, module, message):
    monkeypatch.chdir(tmp_path)
    errors = _errors(tmp_path, f'[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\n'
                               f'module = "{module}"\nspec = "s"\n')
    assert len(errors) == 1 and errors[0].startswith("pyproject.toml:5: [[tool.graphslot.outputs]] entry 1: ")
    assert message in errors[0]


def test_every_problem_is_reported_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    errors = _errors(tmp_path, '[tool.graphslot]\nspec = []\noutputdir = "g"\nimport_hooks = 1\n')
    assert [e.split(":")[1] for e in errors] == ["2", "3", "4"]


def test_output_dir_must_stay_inside_the_project(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    errors = _errors(project, '[tool.graphslot]\noutput_dir = "../outside"\n' + OUTPUT)
    assert errors == [f"pyproject.toml:2: [tool.graphslot] output_dir '../outside' resolves to {tmp_path}/outside, "
                      f"outside the project ({project}); it must name a directory inside the directory of "
                      "pyproject.toml"]
    (project / "link").symlink_to(tmp_path)
    errors = _errors(project, '[tool.graphslot]\noutput_dir = "link/gen"\n' + OUTPUT)
    assert len(errors) == 1 and f"resolves to {tmp_path}/gen, outside the project" in errors[0]
    errors = _errors(project, '[tool.graphslot]\noutput_dir = "."\n' + OUTPUT)
    assert len(errors) == 1 and "'.' resolves to" in errors[0]


@pytest.mark.parametrize("line, named, what", [('specs = ["loop/tiny.yaml"]', "specs: 'loop/tiny.yaml'", "a file"),
                                               ('output_dir = "loop/gen"', "output_dir 'loop/gen'", "a directory")])
def test_a_path_through_a_symbolic_link_loop_is_named_as_one_outside_is(tmp_path, monkeypatch, capsys, line, named,
                                                                          what):
    """``Path.resolve`` raises RuntimeError on a loop (Python 3.11): it was a traceback from
    ``generate`` and an error naming neither the line nor the entry from the others."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    text = f"[tool.graphslot]\n{line}\n" + (OUTPUT if what == "a directory" else "")
    expected = (f"pyproject.toml:2: [tool.graphslot] {named} cannot be resolved (a loop of symbolic links); it must "
                f"name {what} inside the directory of pyproject.toml")
    assert _errors(tmp_path, text) == [expected]
    for argv in (["generate"], ["validate"], ["show", "tiny"]):
        assert main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert expected in out + err and "Traceback" not in out + err, argv


def test_non_utf8_pyproject(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_bytes(b'[tool.graphslot]\noutput_dir = "g\xff"\n')
    with pytest.raises(ProjectConfigError) as info:
        load_project_config(tmp_path)
    assert str(info.value) == "pyproject.toml:2: is not valid UTF-8"


def test_import_hooks(tmp_path):
    _write(tmp_path, '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n')
    assert load_project_config(tmp_path).import_hooks is False
    _write(tmp_path, '[tool.graphslot]\nimport_hooks = true\n')
    assert load_project_config(tmp_path).import_hooks is True
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert load_project_config(tmp_path).import_hooks is False


def test_valid_config_is_exposed(tmp_path):
    _write(tmp_path, '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\noutput_dir = "pkg/gen"\n' + OUTPUT
           + 'params = { fill = 2, name = "x" }\npreset = "eager"\n')
    config = load_project_config(tmp_path)
    assert config.output_dir == "pkg/gen" and config.specs == [(tmp_path / "specs" / "tiny.yaml").resolve()]
    [output] = config.outputs
    assert (output.module, output.spec, output.preset, dict(output.params), output.line) == (
        "tiny_default", "specs/tiny.yaml", "eager", {"fill": 2, "name": "x"}, 5)


@pytest.mark.parametrize("text, expected", [
    ('[tool.graphslot]\nspec = ["specs/tiny.yaml"]\noutput_dir = "gen"\n' + OUTPUT,
     "pyproject.toml:2: [tool.graphslot]: unknown key 'spec'; did you mean 'specs'?"),
    ('[tool.graphslot]\noutput_dir = 5\n' + OUTPUT,
     "pyproject.toml:2: [tool.graphslot] output_dir must be a path (a string), got an integer"),
    ('[tool.graphslot]\noutput_dir = "gen"\n' + OUTPUT + 'params = 3\n',
     "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1 params must be a table"),
    ('[tool.graphslot]\noutput_dir = "../x"\n' + OUTPUT, "pyproject.toml:2: [tool.graphslot] output_dir '../x' "
                                                          "resolves to"),
])
def test_cli_prints_file_line_message_and_exits_1(tmp_path, monkeypatch, capsys, text, expected):
    project = tmp_path / "p"
    project.mkdir()
    _write(project, text)
    monkeypatch.chdir(project)
    for argv in (["generate"], ["generate", "--check"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert err.startswith(expected), err
        assert "Traceback" not in out + err
    assert not (project / "gen").exists()


BOM = "\ufeff"


def test_a_byte_order_mark_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # TOML has no byte-order mark: tomllib (which pip and build read pyproject.toml with)
    # refuses one, so graphslot says what it is instead of accepting what they refuse.
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(BOM + '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n')
    message = ("pyproject.toml:1: starts with a UTF-8 byte-order mark, which TOML does not allow (tomllib, and so "
               "pip, refuse it); save it without one")
    assert _errors(tmp_path, BOM + '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n') == [message]
    for argv in (["validate"], ["generate", "--check"], ["new-spec", "--from", "decode", "specs/new.yaml"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert err.splitlines()[-1].endswith(message) and "Traceback" not in out + err
    assert not (tmp_path / "specs" / "new.yaml").exists()


def test_a_spec_file_may_start_with_a_byte_order_mark(tmp_path, monkeypatch, capsys):
    # YAML allows one, so a spec that starts with it reads as without it.
    _write(tmp_path, '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n')
    (tmp_path / "specs" / "tiny.yaml").write_text(BOM + SPEC)
    monkeypatch.chdir(tmp_path)
    assert main(["validate"]) == 0
    assert capsys.readouterr().out == "ok  specs/tiny.yaml (1 slots)\n"


def test_a_pyproject_over_the_size_limit_is_not_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n# padding\n'
    _write(tmp_path, text + "#" * (MAX_PYPROJECT_BYTES - len(text) - 1) + "\n")
    assert load_project_config(tmp_path).specs == [(tmp_path / "specs" / "tiny.yaml").resolve()]
    assert _errors(tmp_path, text + "#" * (MAX_PYPROJECT_BYTES - len(text)) + "\n") == [
        "pyproject.toml: the file is larger than 1048576 bytes; a pyproject.toml is a few KiB"]


@pytest.mark.parametrize("line, number", [
    (".".join(["a"] * 129) + " = 1", 3),
    ("[" + ".".join(['"a"'] * 129) + "]", 3),
    ("x = { b = 1, " + " . ".join(["'a'"] * 129) + " = 1 }", 3),
], ids=["key", "header", "inline table"])
def test_a_key_of_more_than_128_parts_is_not_parsed(tmp_path, monkeypatch, line, number):
    monkeypatch.chdir(tmp_path)
    assert _errors(tmp_path, '[project]\nname = "x"\n' + line + "\n") == [
        f"pyproject.toml:{number}: a dotted key of more than 128 parts: TOML parsers take time and memory "
        "quadratic in them, so graphslot does not read the file"]


def test_keys_of_128_parts_and_dots_in_strings_are_fine(tmp_path):
    _write(tmp_path, '[project]\nname = "x"\n' + ".".join(["a"] * 128) + " = 1\n"
           + 'description = "' + "a." * 500 + '"\nurls = { home = "' + "x." * 300 + '" }\n'
           + '[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n')
    assert load_project_config(tmp_path).specs == [(tmp_path / "specs" / "tiny.yaml").resolve()]


@pytest.mark.parametrize("value", ["[" * 600 + "]" * 600, "{a = " * 400 + "1" + "}" * 400],
                         ids=["arrays", "inline tables"])
def test_deeply_nested_values_are_one_error(tmp_path, monkeypatch, capsys, value):
    monkeypatch.chdir(tmp_path)
    message = "pyproject.toml: not valid TOML: arrays or inline tables nested too deeply"
    assert _errors(tmp_path, f"x = {value}\n") == [message]
    assert main(["generate"]) == 1
    out, err = capsys.readouterr()
    assert err == message + "\n" and out == ""


def test_header_and_key_lines_are_found_in_any_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = ('[project]\nname = "x"\n\n  [ tool . "graphslot" ]   # settings\n  "specs" = 5\n'
            "  [[tool.'graphslot'.outputs]]\n  module = 7\n  spec = 'specs/tiny.yaml'\n")
    assert _errors(tmp_path, text) == [
        "pyproject.toml:5: [tool.graphslot] specs must be a list of paths (strings), got 5",
        "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1: module must be a string, got an integer"]


SECRET = "name: TOPSECRET\nslots: [TOPSECRET\n"  # invalid: an error would quote it


def test_listed_specs_must_stay_inside_the_project_and_are_never_read_outside(tmp_path, monkeypatch, capsys):
    """Issue 37: ``specs`` entries outside the project were read and their text echoed
    into error lines; they are refused as ``output_dir`` is, naming the line."""
    project = tmp_path / "project"
    project.mkdir()
    (tmp_path / "secret.yaml").write_text(SECRET)
    (project / "link").symlink_to(tmp_path)
    monkeypatch.chdir(project)
    inside = "it must name a file inside the directory of pyproject.toml"
    cases = {
        "../secret.yaml": f"resolves to {tmp_path}/secret.yaml, outside the project ({project}); {inside}",
        "link/secret.yaml": f"resolves to {tmp_path}/secret.yaml, outside the project ({project}); {inside}",
        "/etc/secret.yaml": "is absolute; it must be relative to the directory of pyproject.toml",
    }
    for listed, problem in cases.items():
        text = f'[tool.graphslot]\noutput_dir = "gen"\nspecs = ["specs/tiny.yaml", "{listed}"]\n' + OUTPUT
        assert _errors(project, text) == [f"pyproject.toml:3: [tool.graphslot] specs: '{listed}' {problem}"]
        for argv in (["generate"], ["validate"], ["validate", "secret"], ["show", "secret"]):
            assert main(argv) == 1, argv
            out, err = capsys.readouterr()
            assert f"pyproject.toml:3: [tool.graphslot] specs: '{listed}' {problem}" in out + err, argv
            assert "TOPSECRET" not in out + err and "Traceback" not in out + err
    text = '[tool.graphslot]\noutput_dir = "gen"\n' + OUTPUT.replace("specs/tiny.yaml", "../secret.yaml")
    _write(project, text)
    assert main(["generate"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("pyproject.toml:6: [[tool.graphslot.outputs]] entry 1 (module 'tiny_default'): spec "
                          f"'../secret.yaml' resolves to {tmp_path}/secret.yaml, outside the project ({project}); "
                          f"{inside}"), err
    assert "TOPSECRET" not in out + err and not (project / "gen").exists()
