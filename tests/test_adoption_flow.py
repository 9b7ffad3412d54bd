"""An engine adopting graphslot in its own repository (issue 25), end to end, as its team
would: the ``graphslot`` command run as its console script (whose directory, not the
project, is ``sys.path[0]``) in a clean environment, from the project's root.

A fresh project starts its spec with ``new-spec --from decode`` (so it keeps ``name:
decode``), adds a slot filled by a hook of its own package, validates with
``--import-hooks``, generates its module, and builds a registry from that module alone
-- the YAML gone, from another working directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graphslot.spec.pyproject_text import tomllib

from conftest import DECODE_SLOTS, LORA_IDS_SLOT

REPO = Path(__file__).resolve().parent.parent
ENTRY = "import sys\nfrom graphslot.cli import main\nsys.exit(main())\n"  # what pip's `graphslot` script runs
HOOKS = '''"""myengine's slot hooks."""


def fill_lora_ids(buffer, fb, ctx):
    buffer[: ctx.raw_bs].fill_(7)
'''
# The engine's slot, filled by its own hook.
EXTRA_SLOT = LORA_IDS_SLOT + "    copy_from_fb: false\n    post_fill: myengine.hooks:fill_lora_ids\n"
OUTPUTS = """\
output_dir = "myengine/generated"

[[tool.graphslot.outputs]]
module = "decode_default"
spec = "decode"
"""


def clean_env(tmp_path: Path, *paths: Path) -> dict:
    """No PYTHONPATH but graphslot's (and ``paths``), no project on the path."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"),
            "PYTHONPATH": os.pathsep.join(str(p) for p in (REPO, *paths)), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture
def graphslot(tmp_path):
    """Run ``graphslot ARGS`` in ``cwd`` as the installed console script does."""
    script = tmp_path / "bin" / "graphslot"
    script.parent.mkdir()
    script.write_text(ENTRY)

    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=clean_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc

    return run


@pytest.fixture
def engine(tmp_path, graphslot):
    """The engine's project after new-spec, its slot, its hooks and its outputs."""
    root = tmp_path / "engine"
    root.mkdir()
    (root / "pyproject.toml").write_text('[project]\nname = "myengine"\nversion = "0.1.0"\n')
    proc = graphslot(root, "new-spec", "--from", "decode", "specs/decode.yaml")
    assert proc.returncode == 0, proc.stderr
    spec = root / "specs" / "decode.yaml"
    assert "\nname: decode\n" in spec.read_text()  # new-spec keeps the shipped name
    spec.write_text(spec.read_text() + EXTRA_SLOT)
    (root / "myengine").mkdir()
    (root / "myengine" / "__init__.py").write_text("")
    (root / "myengine" / "hooks.py").write_text(HOOKS)
    pyproject = root / "pyproject.toml"
    assert list(tomllib.loads(pyproject.read_text())["tool"]["graphslot"]) == ["specs"]
    assert pyproject.read_text().rstrip().endswith('specs = ["specs/decode.yaml"]')  # the table comes last
    pyproject.write_text(pyproject.read_text() + OUTPUTS)
    return root


def test_the_scratch_engine_flow(engine, graphslot, tmp_path):
    proc = graphslot(engine, "validate", "--import-hooks")
    ok = f"ok  specs/decode.yaml ({DECODE_SLOTS + 1} slots)\n"
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, ok, "")
    proc = graphslot(engine, "show", "decode")  # the project's decode, not graphslot's
    assert proc.returncode == 0 and proc.stdout.startswith("decode (specs/decode.yaml): max_bs=256")
    assert any(line.split()[:1] == ["lora_ids"] for line in proc.stdout.splitlines())
    proc = graphslot(engine, "generate")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["wrote    myengine/generated/__init__.py",
                                        "wrote    myengine/generated/decode_default.py",
                                        "1 generated module(s): 1 written, 0 unchanged"]
    assert graphslot(engine, "generate", "--check").returncode == 0

    shutil.rmtree(engine / "specs")  # the module alone, from another directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    program = textwrap.dedent("""\
        import json, torch
        from types import SimpleNamespace
        import graphslot as gs
        import myengine.generated.decode_default as module

        reg = gs.build_registry(module, device="cpu", max_bs=8, max_num_tokens=8)
        ar = torch.arange(3)
        fb = SimpleNamespace(batch_size=3, input_ids=ar + 10, positions=ar + 3, out_cache_loc=ar + 7,
                             req_pool_indices=ar + 1, seq_lens=ar + 4, seq_lens_cpu=ar + 4, mrope_positions=None)
        reg.fill_from(fb, raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=4)
        print(json.dumps({"slots": [s.name for s in reg.active], "source": reg.spec.path,
                          "lora_ids": reg.slot("lora_ids").buffer.tolist(), "cwd_has_yaml": False}))
        """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=elsewhere, env=clean_env(tmp_path, engine),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["slots"][-1] == "lora_ids"
    assert result["source"] == "specs/decode.yaml (embedded in myengine.generated.decode_default)"
    assert result["lora_ids"] == [7, 7, 7, 0, 0, 0, 0, 0]  # the engine's hook ran; the padded row is zero


def test_import_hooks_from_pyproject_and_from_a_subdirectory(engine, graphslot):
    pyproject = engine / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('specs = ["specs/decode.yaml"]\n',
                                                       'specs = ["specs/decode.yaml"]\nimport_hooks = true\n'))
    proc = graphslot(engine, "validate")
    assert (proc.returncode, proc.stdout) == (0, f"ok  specs/decode.yaml ({DECODE_SLOTS + 1} slots)\n")
    proc = graphslot(engine / "myengine", "validate")  # the project root is the pyproject's directory
    shown = engine / "specs" / "decode.yaml"
    assert proc.returncode == 0 and proc.stdout == f"ok  {shown} ({DECODE_SLOTS + 1} slots)\n"
    proc = graphslot(engine, "show", "decode", "--import-hooks", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["unchecked_hook_imports"] == 0


NOT_INSTALLED = ("; install it (and what it imports) into this environment -- for a pre-commit hook, list it under "
                 "additional_dependencies or use a `repo: local` hook -- or check hooks here without importing them "
                 "(no --import-hooks, import_hooks = false)")


def test_a_hook_whose_dependency_is_not_installed_says_what_to_do(engine, graphslot):
    """As in a pre-commit environment without the engine's dependencies (torch, say)."""
    (engine / "myengine" / "hooks.py").write_text("import not_installed_here\n" + HOOKS)
    proc = graphslot(engine, "validate", "--import-hooks")
    line = next(i + 1 for i, text in enumerate((engine / "specs" / "decode.yaml").read_text().splitlines())
                if "post_fill: myengine.hooks" in text)
    assert (proc.returncode, proc.stderr) == (1, "1 error(s) in 1 of 1 spec file(s)\n")
    assert proc.stdout == (
        f"specs/decode.yaml:{line}: slot 'lora_ids': cannot import module 'myengine.hooks' for hook "
        f"'myengine.hooks:fill_lora_ids': no module named 'not_installed_here' in this Python environment "
        f"({sys.executable}){NOT_INSTALLED}\n")


def test_a_hook_package_not_in_the_project_root_says_what_to_do(engine, graphslot):
    """A src/ layout: the package is importable only once installed."""
    (engine / "src").mkdir()
    shutil.move(engine / "myengine", engine / "src" / "myengine")
    proc = graphslot(engine, "validate", "--import-hooks")
    assert proc.returncode == 1
    assert (f"cannot import module 'myengine.hooks' for hook 'myengine.hooks:fill_lora_ids': no module named "
            f"'myengine' in this Python environment ({sys.executable}){NOT_INSTALLED}\n") in proc.stdout


def test_hooks_are_imported_with_the_project_root_on_the_path_and_the_path_restored(engine, monkeypatch, capsys):
    from graphslot.cli import main

    monkeypatch.chdir(engine)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(engine))])
    before = list(sys.path)
    try:
        assert main(["validate", "--import-hooks"]) == 0
        assert sys.path == before  # scoped to the hook imports
        assert str(engine) not in sys.path and sys.modules["myengine.hooks"].__file__ == str(
            engine / "myengine" / "hooks.py")
    finally:
        for name in [n for n in sys.modules if n == "myengine" or n.startswith("myengine.")]:
            del sys.modules[name]
    assert capsys.readouterr().out == f"ok  specs/decode.yaml ({DECODE_SLOTS + 1} slots)\n"
