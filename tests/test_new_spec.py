"""``graphslot new-spec --from SHIPPED PATH``: start a spec from a shipped one and list
it under ``[tool.graphslot] specs``.

The spec is the shipped text byte for byte after one provenance comment; pyproject.toml
is edited as text, keeping the user's layout and comments, and only when the result
parses to the old document plus the new path; nothing is written outside the project,
no file is overwritten, and every failure is one ``graphslot new-spec: error:`` line.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphslot import __version__
from graphslot.cli import new_spec as new_spec_module
from graphslot.cli.app import COMMANDS, main
from graphslot.cli.new_spec import renamed
from graphslot.cli.pyproject_edit import add_spec_entry, pyproject_with_entry
from graphslot.spec.loading import SHIPPED_DIR, parse_spec
from graphslot.spec.project import output_dir_problem

ERROR = "graphslot new-spec: error: "
PROVENANCE = f"# Started from the shipped 'decode' spec of graphslot {__version__} (graphslot new-spec).\n"


def shipped(name: str = "decode") -> bytes:
    return (SHIPPED_DIR / f"{name}.yaml").read_bytes()


def expected_spec(name: str = "decode") -> bytes:
    """The shipped text with the provenance line after its first line (the editor modeline)."""
    first, rest = shipped(name).split(b"\n", 1)
    return first + b"\n" + PROVENANCE.replace("'decode'", f"'{name}'").encode() + rest


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def new_spec(capsys, *argv):
    return run(capsys, "new-spec", *argv)


def one_error(err: str) -> str:
    """The single stderr line of a failed run."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), err
    return lines[0].removeprefix(ERROR)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty directory, the current one; ``project(text)`` writes its pyproject.toml."""
    monkeypatch.chdir(tmp_path)

    def write(text=None):
        if text is not None:
            (tmp_path / "pyproject.toml").write_bytes(text.encode())
        return tmp_path

    return write


@pytest.fixture
def umask():
    def set_umask(value):
        os.umask(value)

    old = os.umask(0o022)
    yield set_umask
    os.umask(old)


def files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_the_command_is_registered():
    assert "new-spec" in COMMANDS


# --- the spec file -------------------------------------------------------------------


def test_copies_the_shipped_spec_byte_for_byte_after_a_provenance_line(project, capsys):
    root = project()
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, err) == (0, "")
    text = (root / "specs" / "decode.yaml").read_bytes()
    assert text == expected_spec()
    assert text.startswith(b"# yaml-language-server: $schema=graphslot.schema.json\n" + PROVENANCE.encode())


def test_prefill_too(project, capsys):
    root = project()
    assert new_spec(capsys, "--from", "prefill", "prefill.yml")[0] == 0
    assert (root / "prefill.yml").read_bytes() == expected_spec("prefill")


def test_what_it_prints(project, capsys):
    project('[project]\nname = "engine"\n')
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, err) == (0, "")
    assert out == (
        f"created  specs/decode.yaml (from the shipped 'decode' spec of graphslot {__version__})\n"
        'added    "specs/decode.yaml" to [tool.graphslot] specs in pyproject.toml\n'
        "\n"
        "next:\n"
        "  1. edit specs/decode.yaml (the format: slot_specs/README.md in the graphslot package)\n"
        "     for completion in your editor: graphslot schema --output specs/graphslot.schema.json\n"
        "  2. graphslot validate\n"
        "  3. to generate its code, add an output to pyproject.toml and run graphslot generate:\n"
        "\n"
        "       [[tool.graphslot.outputs]]\n"
        '       module = "decode_default"\n'
        '       spec = "specs/decode.yaml"\n'
        "\n"
        "     and, under [tool.graphslot], where generated modules go:\n"
        '       output_dir = "mypackage/generated"\n'
    )


def test_the_suggested_output_avoids_taken_module_names_and_known_output_dir(project, capsys):
    project('[tool.graphslot]\noutput_dir = "gen"\n\n[[tool.graphslot.outputs]]\nmodule = "decode_default"\n'
            'spec = "decode"\n')
    (project() / "specs").mkdir()
    (project() / "specs" / "graphslot.schema.json").write_text("{}")
    status, out, _ = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 0
    assert 'module = "decode_default_2"' in out
    assert "output_dir" not in out  # already set
    assert "graphslot schema" not in out  # the schema is already there


def test_the_new_spec_passes_graphslot_validate(project, capsys):
    project('[project]\nname = "engine"\n')
    assert new_spec(capsys, "--from", "decode", "specs/decode.yaml")[0] == 0
    assert new_spec(capsys, "--from", "prefill", "specs/prefill.yaml")[0] == 0
    status, out, err = run(capsys, "validate")  # the project's specs, as registered
    assert status == 0, out + err
    assert "ok  specs/decode.yaml (15 slots)" in out
    assert "ok  specs/prefill.yaml (11 slots)" in out
    assert run(capsys, "validate", "specs/decode.yaml")[0] == 0


def test_name_sets_the_spec_name_and_nothing_else(project, capsys):
    root = project()
    status, out, err = new_spec(capsys, "--from", "decode", "--name", "my_decode", "specs/mine.yaml")
    assert (status, err) == (0, "")
    text = (root / "specs" / "mine.yaml").read_bytes()
    assert text == expected_spec().replace(b"\nname: decode\n", b"\nname: my_decode\n")
    assert parse_spec(text.decode()).name == "my_decode"
    assert 'module = "my_decode_default"' in out
    assert run(capsys, "validate")[0] == 0


def test_a_name_yaml_reads_as_another_type_is_quoted():
    text = renamed("# c\nname: decode  # the name\nslots: []\n", "yes")
    assert text == "# c\nname: 'yes'  # the name\nslots: []\n"


@pytest.mark.parametrize("name", ["my-spec", "1st", "a b", ""])
def test_name_must_be_an_identifier(project, capsys, name):
    root = project()
    status, _, err = new_spec(capsys, "--from", "decode", "--name", name, "specs/x.yaml")
    assert status == 2 and "argument --name:" in err and "is not an identifier" in err
    assert files(root) == []


def test_wrong_from_is_a_usage_error_with_did_you_mean(project, capsys):
    root = project()
    status, _, err = new_spec(capsys, "--from", "decod", "specs/x.yaml")
    assert status == 2
    assert err.splitlines()[-1] == ("graphslot new-spec: error: argument --from: no shipped spec 'decod'; "
                                    "did you mean 'decode'? (shipped specs: decode, prefill, vllm)")
    assert files(root) == []


def test_from_is_required(project, capsys):
    status, _, err = new_spec(capsys, "specs/x.yaml")
    assert status == 2 and "--from" in err


# --- refusals ------------------------------------------------------------------------


def test_an_existing_destination_is_never_overwritten(project, capsys):
    root = project('[tool.graphslot]\nspecs = []\n')
    (root / "specs").mkdir()
    (root / "specs" / "decode.yaml").write_text("mine\n")
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, out) == (1, "")
    assert one_error(err) == ("'specs/decode.yaml' already exists; refusing to overwrite it (choose another "
                              "path, or move the file away first)")
    assert (root / "specs" / "decode.yaml").read_text() == "mine\n"
    assert (root / "pyproject.toml").read_text() == '[tool.graphslot]\nspecs = []\n'


def test_a_dangling_symlink_at_the_destination_is_refused(project, capsys, tmp_path_factory):
    root = project()
    target = tmp_path_factory.mktemp("elsewhere") / "x.yaml"
    (root / "x.yaml").symlink_to(target)
    status, _, err = new_spec(capsys, "--from", "decode", "x.yaml")
    assert status == 1 and one_error(err)
    assert not target.exists()


@pytest.mark.parametrize("dest", ["../outside.yaml", "specs/../../outside.yaml"])
def test_paths_escaping_the_project_are_refused(project, capsys, dest):
    root = project('[project]\nname = "engine"\n')
    status, out, err = new_spec(capsys, "--from", "decode", dest)
    assert (status, out) == (1, "")
    assert one_error(err) == (f"{dest!r} resolves to {root.parent / 'outside.yaml'}, outside the project "
                              f"{root} (the directory of pyproject.toml); the spec must go inside it")
    assert not (root.parent / "outside.yaml").exists()
    assert files(root) == ["pyproject.toml"]


def test_an_absolute_path_outside_is_refused_inside_is_fine(project, capsys, tmp_path_factory):
    root = project()
    outside = tmp_path_factory.mktemp("elsewhere") / "x.yaml"
    status, _, err = new_spec(capsys, "--from", "decode", str(outside))
    assert status == 1 and "outside the project" in one_error(err)
    assert "the current directory: no pyproject.toml was found" in err
    assert not outside.exists() and files(root) == []
    assert new_spec(capsys, "--from", "decode", str(root / "inside.yaml"))[0] == 0
    assert tomllib.loads((root / "pyproject.toml").read_text()) == {"tool": {"graphslot": {"specs": ["inside.yaml"]}}}


def test_a_symlinked_directory_pointing_out_is_refused(project, capsys, tmp_path_factory):
    root = project()
    outside = tmp_path_factory.mktemp("elsewhere")
    (root / "specs").symlink_to(outside, target_is_directory=True)
    status, _, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1 and "outside the project" in one_error(err)
    assert list(outside.iterdir()) == []


def test_a_symlinked_directory_inside_the_project_registers_the_path_as_typed(project, capsys):
    root = project()
    (root / "config" / "specs").mkdir(parents=True)
    (root / "specs").symlink_to(root / "config" / "specs", target_is_directory=True)
    assert new_spec(capsys, "--from", "decode", "specs/decode.yaml")[0] == 0
    assert (root / "config" / "specs" / "decode.yaml").read_bytes() == expected_spec()
    assert tomllib.loads((root / "pyproject.toml").read_text())["tool"]["graphslot"]["specs"] == ["specs/decode.yaml"]


@pytest.mark.parametrize("dest, message", [
    ("specs/decode.txt", "'specs/decode.txt': a spec file's name must end in .yaml or .yml"),
    ("specs", "'specs': a spec file's name must end in .yaml or .yml"),
    ("a\nb.yaml", "the spec's path 'a\\nb.yaml' contains control characters"),
    ("", "the spec's path is empty"),
])
def test_bad_destinations(project, capsys, dest, message):
    root = project()
    status, _, err = new_spec(capsys, "--from", "decode", dest)
    assert status == 1 and one_error(err) == message
    assert files(root) == []


def test_a_file_where_a_directory_should_be(project, capsys):
    root = project()
    (root / "specs").write_text("")
    status, _, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1 and one_error(err) == "cannot create 'specs/decode.yaml': specs is not a directory"


@pytest.mark.parametrize("text, message", [
    ('[tool.graphslot\nspecs = []\n', "pyproject.toml:1: not valid TOML: Expected ']' at the end of a table "
                                      "declaration"),
    ('[tool.graphslot]\nspec = ["a.yaml"]\n', "pyproject.toml:2: [tool.graphslot]: unknown key 'spec'; did you "
                                              "mean 'specs'? (allowed: import_hooks, output_dir, outputs, specs)"),
])
def test_an_invalid_pyproject_gives_validates_errors_and_nothing_is_written(project, capsys, text, message):
    root = project(text)
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, out) == (1, "")
    assert one_error(err) == message
    assert files(root) == ["pyproject.toml"]
    assert (root / "pyproject.toml").read_text() == text
    # `graphslot validate` says the same
    assert message in run(capsys, "validate")[2]


def test_every_problem_of_the_pyproject_is_one_line(project, capsys):
    project('[tool.graphslot]\nspecs = 5\nimport_hooks = "yes"\n')
    status, _, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1
    assert err.splitlines() == [
        ERROR + "pyproject.toml:2: [tool.graphslot] specs must be a list of paths (strings), got 5",
        ERROR + "pyproject.toml:3: [tool.graphslot] import_hooks must be true or false, got a string",
    ]


# --- registering in pyproject.toml ----------------------------------------------------


def test_without_a_pyproject_a_minimal_one_is_created(project, capsys):
    root = project()
    status, out, _ = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 0
    assert 'created  pyproject.toml with [tool.graphslot] specs = ["specs/decode.yaml"]\n' in out
    assert (root / "pyproject.toml").read_text() == '[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n'


def test_from_a_subdirectory_the_path_is_relative_to_the_project_root(project, capsys, monkeypatch):
    root = project('[project]\nname = "engine"\n')
    (root / "engine").mkdir()
    monkeypatch.chdir(root / "engine")
    status, out, _ = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 0
    assert f'added    "engine/specs/decode.yaml" to [tool.graphslot] specs in {root / "pyproject.toml"}' in out
    assert (root / "engine" / "specs" / "decode.yaml").is_file()
    assert (root / "pyproject.toml").read_text() == ('[project]\nname = "engine"\n\n'
                                                     '[tool.graphslot]\nspecs = ["engine/specs/decode.yaml"]\n')


# (pyproject.toml before, after adding "specs/decode.yaml"): the user's text is kept
# byte for byte around the one insertion.
GOLDEN = [
    pytest.param('[project]\nname = "engine"\n',
                 '[project]\nname = "engine"\n\n[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n',
                 id="no table: appended"),
    pytest.param('[project]\nname = "engine"  # no newline at the end',
                 '[project]\nname = "engine"  # no newline at the end\n\n'
                 '[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n',
                 id="no table, no final newline"),
    pytest.param('[tool.graphslot]  # ours\noutput_dir = "gen"\n',
                 '[tool.graphslot]  # ours\nspecs = ["specs/decode.yaml"]\noutput_dir = "gen"\n',
                 id="table without specs"),
    pytest.param('# settings\n[[tool.graphslot.outputs]]\nmodule = "m"\nspec = "decode"\n',
                 '[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n\n'
                 '# settings\n[[tool.graphslot.outputs]]\nmodule = "m"\nspec = "decode"\n',
                 id="outputs only: the table goes before them"),
    pytest.param('[tool.graphslot]\nspecs = []\n',
                 '[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n',
                 id="empty array"),
    pytest.param('[tool.graphslot]\nspecs = ["a.yaml"]  # mine\n',
                 '[tool.graphslot]\nspecs = ["a.yaml", "specs/decode.yaml"]  # mine\n',
                 id="single line"),
    pytest.param("[tool.graphslot]\nspecs = ['a.yaml', \"b.yaml\",]\n",
                 "[tool.graphslot]\nspecs = ['a.yaml', \"b.yaml\", \"specs/decode.yaml\",]\n",
                 id="single line, trailing comma"),
    pytest.param('[tool.graphslot]\nspecs = [\n    "a.yaml",  # first\n    "b.yaml",\n]\noutput_dir = "gen"\n',
                 '[tool.graphslot]\nspecs = [\n    "a.yaml",  # first\n    "b.yaml",\n    "specs/decode.yaml",\n]\n'
                 'output_dir = "gen"\n',
                 id="multi-line, trailing comma"),
    pytest.param('[tool.graphslot]\nspecs = [\n  "a.yaml",\n  "b.yaml"  # last\n]\n',
                 '[tool.graphslot]\nspecs = [\n  "a.yaml",\n  "b.yaml",  # last\n  "specs/decode.yaml"\n]\n',
                 id="multi-line, no trailing comma"),
    pytest.param('[tool.graphslot]\nspecs = [\n    # none yet\n]\n',
                 '[tool.graphslot]\nspecs = [\n    # none yet\n    "specs/decode.yaml",\n]\n',
                 id="multi-line, empty with a comment"),
    pytest.param('[tool.graphslot]\nspecs = [\n    "a.yaml",\n    "b.yaml"]\n',
                 '[tool.graphslot]\nspecs = [\n    "a.yaml",\n    "b.yaml", "specs/decode.yaml"]\n',
                 id="multi-line, bracket after the last entry"),
    pytest.param('[tool.graphslot]\r\nspecs = [\r\n    "a.yaml",\r\n]\r\n',
                 '[tool.graphslot]\r\nspecs = [\r\n    "a.yaml",\r\n    "specs/decode.yaml",\r\n]\r\n',
                 id="CRLF kept"),
    pytest.param('[ tool . "graphslot" ]\n"specs" = [\'\'\'a]".yaml\'\'\']\n',
                 '[ tool . "graphslot" ]\n"specs" = [\'\'\'a]".yaml\'\'\', "specs/decode.yaml"]\n',
                 id="quoted names, a literal string holding ] and a quote"),
]


@pytest.mark.parametrize("before, after", GOLDEN)
def test_pyproject_edits_are_minimal(project, capsys, before, after):
    root = project(before)
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, err) == (0, ""), err
    assert 'added    "specs/decode.yaml" to [tool.graphslot] specs in pyproject.toml\n' in out
    assert (root / "pyproject.toml").read_bytes() == after.encode()


@pytest.mark.parametrize("before, after", GOLDEN)
def test_the_edit_alone_is_the_documented_text(before, after):
    assert pyproject_with_entry(before, "specs/decode.yaml") == after


def test_odd_characters_in_the_path_are_escaped():
    text = pyproject_with_entry("", 'a"b\\c.yaml')
    assert text == '[tool.graphslot]\nspecs = ["a\\"b\\\\c.yaml"]\n'
    assert tomllib.loads(text)["tool"]["graphslot"]["specs"] == ['a"b\\c.yaml']


def test_an_already_listed_path_is_not_added_again(project, capsys):
    before = '[tool.graphslot]\nspecs = ["./specs//decode.yaml"]  # listed, file not made yet\n'
    root = project(before)
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert (status, err) == (0, "")
    assert ('listed   "specs/decode.yaml" is already in [tool.graphslot] specs of pyproject.toml; '
            "left as it is\n") in out
    assert (root / "pyproject.toml").read_text() == before
    assert (root / "specs" / "decode.yaml").read_bytes() == expected_spec()


@pytest.mark.parametrize("text", [
    '[tool]\ngraphslot.specs = ["a.yaml"]\n',
    'tool.graphslot.specs = ["a.yaml"]\n',
    'notes = """\n[tool.graphslot]\nspecs = []\n"""\n[tool.graphslot]\noutput_dir = "gen"\n',
])
def test_a_layout_it_cannot_edit_safely_is_left_alone(project, capsys, text):
    root = project(text)
    status, out, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1
    assert out.startswith("created  specs/decode.yaml")  # the spec is there; only listing it is left
    message = one_error(err)
    assert message.startswith("specs/decode.yaml was created, but pyproject.toml was left unchanged (its layout "
                              "is not one graphslot can edit safely")
    hand = 'specs = [..., "specs/decode.yaml"]' if "a.yaml" in text else 'specs = ["specs/decode.yaml"]'
    assert message.endswith(f"; add the path by hand under [tool.graphslot]: {hand}")
    assert (root / "pyproject.toml").read_text() == text
    assert (root / "specs" / "decode.yaml").read_bytes() == expected_spec()


def test_a_symlinked_pyproject_is_not_written_through(project, capsys, tmp_path_factory):
    root = project()
    real = tmp_path_factory.mktemp("elsewhere") / "pyproject.toml"
    real.write_text('[project]\nname = "engine"\n')
    (root / "pyproject.toml").symlink_to(real)
    status, _, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1
    assert "(it is a symbolic link, and graphslot does not write through links)" in one_error(err)
    assert real.read_text() == '[project]\nname = "engine"\n' and (root / "pyproject.toml").is_symlink()


PATHS = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(
    lambda t: t.isprintable() and t.strip() and output_dir_problem(t) is None)  # an absolute path is refused
BLANK = st.lists(st.sampled_from([" ", "\t", "\n", "\n    ", "  # a comment\n", "\r\n"]), max_size=3).map("".join)


def toml_literal(text, literal):
    if literal and "'" not in text:
        return f"'{text}'"
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@settings(max_examples=300, deadline=None)
@given(paths=st.lists(st.tuples(PATHS, st.booleans(), BLANK, BLANK), max_size=4), trailing=st.booleans(),
       key=st.sampled_from(["specs", '"specs"', "'specs'"]), opening=BLANK, entry=PATHS,
       after=st.sampled_from(["", "\noutput_dir = 'gen'\n", "\n[project]\nname = 'x'\n"]))
def test_any_array_of_strings_gets_the_entry_and_nothing_else_changes(paths, trailing, key, opening, entry, after):
    """Whatever the spacing, comments, quoting and commas of a specs array, the path is
    added and the document is otherwise the same (verify_addition checks it too)."""
    items = [toml_literal(p, lit) + before + ("," if i < len(paths) - 1 or trailing else "") + gap
             for i, (p, lit, before, gap) in enumerate(paths)]
    before_text = f"[tool.graphslot]\n{key} = [{opening}{''.join(items)}]\n{after}"
    old = tomllib.loads(before_text)
    new_text = pyproject_with_entry(before_text, entry)
    new = tomllib.loads(new_text)
    old["tool"]["graphslot"]["specs"].append(entry)
    assert new == old
    assert new_text.startswith(f"[tool.graphslot]\n{key} = [")
    assert new_text.endswith(f"]\n{after}")


def test_edits_are_insertions_only():
    before = '[tool.graphslot]\nspecs = [\n    "a.yaml",\n]\n'
    after = add_spec_entry(before, "b.yaml")
    assert after.replace('    "b.yaml",\n', "", 1) == before


# --- modes ---------------------------------------------------------------------------


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_get_the_umask_mode(project, capsys, umask, mask, mode):
    root = project()
    umask(mask)
    assert new_spec(capsys, "--from", "decode", "specs/decode.yaml")[0] == 0
    assert stat.S_IMODE((root / "specs" / "decode.yaml").stat().st_mode) == mode
    assert stat.S_IMODE((root / "pyproject.toml").stat().st_mode) == mode


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_an_edited_pyproject_keeps_its_mode(project, capsys, umask, mode):
    root = project('[project]\nname = "engine"\n')
    os.chmod(root / "pyproject.toml", mode)
    umask(0o022)
    assert new_spec(capsys, "--from", "decode", "specs/decode.yaml")[0] == 0
    assert stat.S_IMODE((root / "pyproject.toml").stat().st_mode) == mode
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left


def test_no_temporary_files_are_left(project, capsys):
    root = project('[tool.graphslot]\nspecs = []\n')
    assert new_spec(capsys, "--from", "decode", "specs/decode.yaml")[0] == 0
    assert files(root) == ["pyproject.toml", "specs", "specs/decode.yaml"]


# --- concurrent runs ------------------------------------------------------------------------


def listed_specs(root) -> list:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["graphslot"]["specs"]


def run_together(monkeypatch, root, count: int) -> list:
    """``count`` new-spec runs in threads, adding specs/sN.yaml: every run plans (reads
    pyproject.toml) before any writes it. Their exit statuses."""
    planned = threading.Barrier(count, timeout=60)
    plan = new_spec_module.plan_new_spec

    def plan_then_wait(*args):
        result = plan(*args)
        planned.wait()
        return result

    monkeypatch.setattr(new_spec_module, "plan_new_spec", plan_then_wait)
    statuses = [None] * count

    def one(i):
        statuses[i] = new_spec_module.new_spec("decode", f"specs/s{i}.yaml", None, root)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses


@pytest.mark.parametrize("before", ['[project]\nname = "engine"\n\n[tool.graphslot]\nspecs = []\n', None],
                         ids=["pyproject.toml", "none yet"])
def test_concurrent_runs_all_land_their_entry(project, capsys, monkeypatch, before):
    root = project(before)
    statuses = run_together(monkeypatch, root, 6)
    out, err = capsys.readouterr()
    assert statuses == [0] * 6, err
    assert sorted(listed_specs(root)) == [f"specs/s{i}.yaml" for i in range(6)]
    assert out.count("added    ") + out.count("created  pyproject.toml") == 6
    assert [p.name for p in root.iterdir() if p.name.endswith(".tmp")] == []
    assert main(["validate"]) == 0


def test_concurrent_processes_all_land_their_entry(project):
    root = project('[tool.graphslot]\nspecs = []\n')
    runs = [subprocess.Popen([sys.executable, "-m", "graphslot.cli", "new-spec", "--from", "prefill",
                              f"specs/p{i}.yaml"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(6)]
    results = [(run.wait(120), run.stderr.read().decode()) for run in runs]
    for run in runs:
        run.stdout.close()
        run.stderr.close()
    assert results == [(0, "")] * 6
    assert sorted(listed_specs(root)) == [f"specs/p{i}.yaml" for i in range(6)]


def test_a_run_waits_for_the_lock_and_says_when_it_gives_up(project, capsys, monkeypatch):
    fcntl = pytest.importorskip("fcntl")  # no advisory locks on Windows: there the re-read alone guards
    root = project('[tool.graphslot]\nspecs = []\n')
    monkeypatch.setattr(new_spec_module, "LOCK_WAIT_S", 0.3)
    with open(root / "pyproject.toml", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        status, _, err = new_spec(capsys, "--from", "decode", "specs/decode.yaml")
    assert status == 1 and one_error(err) == (
        "specs/decode.yaml was created, but pyproject.toml was left unchanged (another process held its lock for "
        'over 0.3 s); add the path by hand under [tool.graphslot]: specs = ["specs/decode.yaml"]')
    assert listed_specs(root) == []
    status, _, err = new_spec(capsys, "--from", "decode", "specs/other.yaml")  # the lock is free again
    assert (status, err) == (0, "") and listed_specs(root) == ["specs/other.yaml"]
