"""Spec names mean the project's own specs first (issue 25, point 2).

A project that starts its spec with ``graphslot new-spec --from decode specs/decode.yaml``
keeps ``name: decode``; inside the project ``decode`` must mean that file -- for
``graphslot show``/``validate``, ``load_spec``, ``build_registry`` and an output entry --
never silently graphslot's shipped spec, and every message names the file used.
"""

from __future__ import annotations


import pytest

import graphslot as gs
from graphslot.cli.aot import plan_outputs
from graphslot.spec.loading import SHIPPED_DIR
from graphslot.spec.project import load_project_config

from conftest import DECODE_SLOTS, LORA_IDS_SLOT, PREFILL_SLOTS, cli

SHIPPED_DECODE = (SHIPPED_DIR / "decode.yaml").read_text()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project whose specs/decode.yaml is the shipped decode spec plus one slot; the
    working directory is its root."""
    root = tmp_path / "engine"
    (root / "specs").mkdir(parents=True)
    (root / "specs" / "decode.yaml").write_text(SHIPPED_DECODE + LORA_IDS_SLOT)
    (root / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/decode.yaml"]\n')
    monkeypatch.chdir(root)
    return root


def _slots(spec: gs.RegistrySpec) -> list:
    return [s.name for s in spec.slots]


def test_load_spec_and_build_registry_use_the_projects_spec(project):
    spec = gs.load_spec("decode")
    assert spec.path == "specs/decode.yaml" and _slots(spec)[-1] == "lora_ids"
    reg = gs.build_registry("decode", max_bs=8, max_num_tokens=8, impl="interpreted", device="cpu")
    assert reg.spec.path == "specs/decode.yaml" and "lora_ids" in reg.slot_names()
    # generated in process, the same spec
    assert "lora_ids" in gs.build_registry("decode", max_bs=8, max_num_tokens=8, device="cpu").slot_names()


def test_from_a_subdirectory_too_and_outside_the_project_the_shipped_one(project, monkeypatch, tmp_path):
    (project / "src").mkdir()
    monkeypatch.chdir(project / "src")
    assert gs.load_spec("decode").path == str(project / "specs" / "decode.yaml")
    monkeypatch.chdir(tmp_path)
    assert gs.load_spec("decode").path == str(SHIPPED_DIR / "decode.yaml")
    assert "lora_ids" not in _slots(gs.load_spec("decode"))


def test_the_cli_names_the_file_used(project, capsys):
    status, out, _ = cli(capsys, "show", "decode")
    assert status == 0 and out.startswith("decode (specs/decode.yaml): max_bs=256 max_num_tokens=256\n")
    assert "lora_ids" in out
    assert cli(capsys, "validate", "decode") == (0, f"ok  specs/decode.yaml ({DECODE_SLOTS + 1} slots)\n", "")


def test_validate_shipped_in_the_project_checks_both(project, capsys):
    status, out, _ = cli(capsys, "validate", "--shipped")
    assert status == 0
    assert out.splitlines() == [f"ok  {SHIPPED_DIR / 'decode.yaml'} ({DECODE_SLOTS} slots)",
                                f"ok  {SHIPPED_DIR / 'prefill.yaml'} ({PREFILL_SLOTS} slots)",
                                f"ok  {SHIPPED_DIR / 'vllm.yaml'} (8 slots; 3 hook imports not checked: "
                                "pass --import-hooks)",
                                f"ok  specs/decode.yaml ({DECODE_SLOTS + 1} slots)"]


def test_a_name_may_be_the_specs_name_field(project):
    """new-spec writes any file name; ``name: decode`` inside makes it what decode means."""
    (project / "specs" / "decode.yaml").rename(project / "specs" / "engine_decode.yaml")
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/engine_decode.yaml"]\n')
    assert gs.load_spec("decode").path == "specs/engine_decode.yaml"
    assert gs.load_spec("engine_decode").path == "specs/engine_decode.yaml"
    assert _slots(gs.load_spec("prefill")) == _slots(gs.load_spec(SHIPPED_DIR / "prefill.yaml"))  # still shipped


def test_a_file_name_wins_over_a_name_field(project):
    (project / "specs" / "other.yaml").write_text(SHIPPED_DECODE)  # name: decode too
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/other.yaml", "specs/decode.yaml"]\n')
    assert gs.load_spec("decode").path == "specs/decode.yaml"


def test_two_project_specs_of_one_name_are_ambiguous(project):
    for sub in ("a", "b"):
        (project / "specs" / sub).mkdir()
        (project / "specs" / sub / "dec.yaml").write_text(SHIPPED_DECODE)
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = ["specs/a/dec.yaml", "specs/b/dec.yaml"]\n')
    with pytest.raises(gs.SpecError) as info:
        gs.load_spec("dec")
    assert str(info.value) == ("dec: the spec name 'dec' matches several of the project's specs (specs/a/dec.yaml, "
                               "specs/b/dec.yaml); pass the path of the one you mean")
    assert gs.load_spec("specs/a/dec.yaml").path == "specs/a/dec.yaml"


def test_an_unknown_name_lists_the_projects_specs_and_the_shipped_ones(project):
    with pytest.raises(gs.SpecError) as info:
        gs.load_spec("decod")
    assert str(info.value) == ("decod: no such spec file; the project's specs are: decode; shipped specs are: "
                               "decode, prefill, vllm; did you mean 'decode'?")


def test_an_unreadable_project_table_is_never_answered_with_the_shipped_spec(project):
    (project / "pyproject.toml").write_text('[tool.graphslot]\nspecs = "specs/decode.yaml"\n')
    with pytest.raises(gs.SpecError) as info:
        gs.load_spec("decode")
    assert str(info.value).splitlines() == [
        "pyproject.toml:2: [tool.graphslot] specs must be a list of paths (strings), got 'specs/decode.yaml'",
        "pyproject.toml: cannot tell which spec a name means while [tool.graphslot] is unreadable: fix it, or "
        "pass the spec's path"]
    assert gs.load_spec(SHIPPED_DIR / "decode.yaml").name == "decode"  # a path needs no project


def test_an_output_entry_naming_decode_generates_from_the_projects_spec(project):
    (project / "pyproject.toml").write_text(
        '[tool.graphslot]\nspecs = ["specs/decode.yaml"]\noutput_dir = "gen"\n\n'
        '[[tool.graphslot.outputs]]\nmodule = "decode_default"\nspec = "decode"\n')
    config = load_project_config(project)
    planned = {p.path.name: p.text for p in plan_outputs(project, config.raw)}
    text = planned["decode_default.py"]
    assert "# Generated by graphslot " + gs.__version__ + " from 'specs/decode.yaml'. DO NOT EDIT." in text
    assert 'SPEC_SOURCE = "specs/decode.yaml"\n' in text and '    "lora_ids",\n' in text
