"""What an engine team adopting graphslot ran into and the docs got wrong (issue 25,
point 4): what a bare ``validate`` checks, the exit status with nothing to do, a TOML key
under the wrong header, generated files left behind by a renamed ``output_dir``, and
dtype spellings of other tools. Through the CLI, exact messages in and out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphslot.cli import main
from graphslot.spec.dtypes import SPELLINGS, parse_dtype
from graphslot.spec.loading import SHIPPED_DIR

from conftest import cli

REPO = Path(__file__).resolve().parent.parent
SPEC = """\
name: tiny
slots:
  - name: seq_lens
    shape: [max_bs]
    dtype: int64
    axis: bs
    padding: zero
"""
PYPROJECT = """\
[tool.graphslot]
specs = ["specs/tiny.yaml"]
output_dir = "{output_dir}"

[[tool.graphslot.outputs]]
module = "tiny_default"
spec = "specs/tiny.yaml"
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "tiny.yaml").write_text(SPEC)
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.format(output_dir="pkg/gen"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- a bare validate: the project's specs only -----------------------------------------------


def test_a_bare_validate_checks_the_projects_specs_only(project, capsys):
    assert cli(capsys, "validate") == (0, "ok  specs/tiny.yaml (1 slots)\n", "")
    status, out, _ = cli(capsys, "validate", "--shipped")
    assert status == 0 and len(out.splitlines()) == 4


def test_the_spec_readme_says_what_a_bare_validate_checks():
    readme = (SHIPPED_DIR / "README.md").read_text()
    section = readme.split("## Validation", 1)[1].split("\n## ", 1)[0]
    assert "checks the shipped specs and the files" not in section
    assert ("Without arguments it\nchecks the files listed under `[tool.graphslot] specs` in the project's "
            "`pyproject.toml`\n(`--shipped` adds graphslot's shipped specs)") in section


# --- nothing to do: exit 2, validate and generate alike --------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["validate"], "graphslot validate: error: nothing to validate (no pyproject.toml found): pass spec files, list "
                   "them under [tool.graphslot] specs in pyproject.toml, or pass --shipped for the specs shipped "
                   "with graphslot\n"),
    (["generate"], "graphslot generate: error: nothing to generate: pyproject.toml (none found) declares no "
                   "[[tool.graphslot.outputs]]; see docs/generate.md\n"),
    (["generate", "--check"], "graphslot generate: error: nothing to generate: pyproject.toml (none found) "
                              "declares no [[tool.graphslot.outputs]]; see docs/generate.md\n"),
])
def test_outside_a_project_there_is_nothing_to_do_exit_2(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, *argv) == (2, "", message)


@pytest.mark.parametrize("command", ["validate", "generate"])
def test_the_help_documents_the_exit_statuses(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"2 when there is nothing to (validate|generate)", text), text


# --- a key under the wrong TOML header ---------------------------------------------------------


def test_output_dir_below_an_outputs_header_gets_the_toml_scope_hint(project, capsys):
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\n\n'
                                            '[[tool.graphslot.outputs]]\nmodule = "tiny_default"\n'
                                            'spec = "specs/tiny.yaml"\noutput_dir = "pkg/gen"\n')
    assert cli(capsys, "generate") == (1, "", (
        "pyproject.toml:7: [[tool.graphslot.outputs]] entry 1: unknown key 'output_dir' (allowed: module, params, "
        "preset, spec); 'output_dir' is a key of [tool.graphslot]: in TOML a key belongs to the table of the last "
        "header above it (indentation does not matter), so move `output_dir = ...` above the first "
        "[[tool.graphslot.outputs]] header, under [tool.graphslot]\n"))


def test_an_output_key_under_the_table_gets_the_hint_too(project, capsys):
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/tiny.yaml"]\nmodule = "tiny"\n')
    status, _, err = cli(capsys, "validate")
    assert status == 1 and err == (
        "graphslot validate: error: pyproject.toml:3: [tool.graphslot]: unknown key 'module' (allowed: "
        "import_hooks, output_dir, outputs, specs); 'module' is a key of [[tool.graphslot.outputs]]: in TOML a "
        "key belongs to the table of the last header above it (indentation does not matter), so move `module = "
        "...` into a [[tool.graphslot.outputs]] entry (one per generated module)\n")


# --- a renamed output_dir ----------------------------------------------------------------------


def _rename_output_dir(project: Path, capsys) -> None:
    assert cli(capsys, "generate")[0] == 0
    (project / "pyproject.toml").write_text(PYPROJECT.format(output_dir="pkg/generated"))


FIX = "run `graphslot generate` and commit the result"
ELSEWHERE = "graphslot generated it, outside output_dir; no output produces it any more"


def test_files_left_in_a_renamed_output_dir_are_reported_and_removed(project, capsys):
    _rename_output_dir(project, capsys)
    status, out, err = cli(capsys, "generate", "--check")
    assert status == 1
    assert out.splitlines() == ["missing: pkg/generated/__init__.py", "missing: pkg/generated/tiny_default.py",
                                f"orphaned: pkg/gen/tiny_default.py ({ELSEWHERE})",
                                f"orphaned: pkg/gen/__init__.py ({ELSEWHERE})"]
    assert err == f"out of date: 1 of 1 generated module(s), the package __init__.py, 2 orphaned file(s); {FIX}\n"
    status, out, _ = cli(capsys, "generate")
    assert status == 0 and out.splitlines() == [
        "wrote    pkg/generated/__init__.py", "wrote    pkg/generated/tiny_default.py",
        "removed  pkg/gen/tiny_default.py", "removed  pkg/gen/__init__.py",
        "1 generated module(s): 1 written, 0 unchanged"]
    assert cli(capsys, "generate", "--check") == (0, "ok  1 generated module(s) up to date\n", "")
    assert sorted(p.name for p in (project / "pkg" / "gen").iterdir()) == []


def test_a_file_graphslot_did_not_write_is_never_reported_nor_removed(project, capsys):
    _rename_output_dir(project, capsys)
    old = project / "pkg" / "gen"
    (old / "notes.py").write_text("# hand-written, next to the old generated module\n")
    (old / "edited.py").write_text((old / "tiny_default.py").read_text().replace("# Generated by", "# Edited by", 1))
    status, out, _ = cli(capsys, "generate", "--check")
    assert status == 1 and [line for line in out.splitlines() if line.startswith("orphaned")] == [
        f"orphaned: pkg/gen/tiny_default.py ({ELSEWHERE})"]  # the package stays: files of others live in it
    assert cli(capsys, "generate")[0] == 0
    assert sorted(p.name for p in old.glob("*.py")) == ["__init__.py", "edited.py", "notes.py"]
    assert cli(capsys, "generate", "--check")[0] == 0


def test_the_search_stays_out_of_other_projects_hidden_directories_environments_and_builds(project, capsys):
    assert cli(capsys, "generate")[0] == 0
    generated = project / "pkg" / "gen"
    for where in ("vendor/other_project/gen", ".cache/gen", "venv/gen", "build/lib/pkg/gen", "dist/gen"):
        copy = project / where
        copy.mkdir(parents=True)
        for name in ("__init__.py", "tiny_default.py"):
            (copy / name).write_text((generated / name).read_text())
    (project / "vendor" / "other_project" / "pyproject.toml").write_text("[project]\nname = 'other'\n")
    (project / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert cli(capsys, "generate", "--check") == (0, "ok  1 generated module(s) up to date\n", "")


def test_a_walk_that_stops_says_so(project, capsys, monkeypatch):
    _rename_output_dir(project, capsys)
    import graphslot.cli.aot as aot
    monkeypatch.setattr(aot, "MAX_DIRS", 1)
    status, _, err = cli(capsys, "generate", "--check")
    assert status == 1 and err.startswith("note: looked for stale generated files in the first 1 directories of "
                                          "the project only\n")


# --- dtypes as other tools spell them ----------------------------------------------------------


@pytest.mark.parametrize("written, meant", [("fp32", "float32"), ("FP16", "float16"), ("bf16", "bfloat16"),
                                            ("f32", "float32"), ("i32", "int32"), ("i64", "int64"),
                                            ("u8", "uint8"), ("fp64", "float64"), ("torch.bf16", "bfloat16")])
def test_dtype_spellings_of_other_tools_get_the_torch_name(written, meant, tmp_path, monkeypatch, capsys):
    (tmp_path / "s.yaml").write_text(SPEC.replace("dtype: int64", f"dtype: {written}"))
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, "validate", "s.yaml") == (1, (
        f"s.yaml:5: slot 'seq_lens': unknown dtype '{written}': use a torch dtype name (int64, int32, bool, "
        f"float32, bfloat16, …) or a dtype param; did you mean '{meant}'?\n"),
        "1 error(s) in 1 of 1 spec file(s)\n")


def test_a_dtype_param_set_in_another_spelling_gets_the_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = cli(capsys, "show", "decode", "--param", "cache_loc_dtype=i32")
    assert status == 1 and err.endswith("param 'cache_loc_dtype' is a dtype: pass torch.int64 or 'int64', got "
                                        "'i32'; did you mean 'int32'?\n")


def test_every_spelling_names_a_dtype_and_none_is_one():
    assert all(parse_dtype(meant) is not None and parse_dtype(written) is None
               for written, meant in SPELLINGS.items())
