"""Packaging: the toolchain installs without torch, and the release instructions name the
release that is being made."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

import graphslot
from graphslot.spec.pyproject_text import tomllib

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_torch_is_an_extra_not_a_dependency():
    project = PYPROJECT["project"]
    assert not [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.4"]


def test_one_version_everywhere():
    assert PYPROJECT["project"]["version"] == graphslot.__version__


GENERATE_DOC = REPO / "docs" / "generate.md"


def _readme_pre_commit_configs() -> list:
    """The YAML blocks of docs/generate.md's "pre-commit" section, parsed."""
    section = GENERATE_DOC.read_text().split("## pre-commit\n", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, re.S)]


def test_the_pre_commit_instructions_work_without_tags():
    """The repository has no release tags: no snippet may pin one (issue 25)."""
    hooks_file = (REPO / ".pre-commit-hooks.yaml").read_text()
    tag = re.compile(r"^[ #]*rev: v\d", re.M)  # a rev line pinning a release tag
    assert not any(tag.search(text) for text in (hooks_file, (REPO / "README.md").read_text(),
                                                  GENERATE_DOC.read_text()))
    hooks = {h["id"]: h for h in yaml.safe_load(hooks_file)}
    # Every hook runs a command of the torch-free toolchain (tests/test_torch_free.py).
    assert {h["entry"] for h in hooks.values()} == {"graphslot validate", "graphslot generate --check"}
    assert all(h["language"] == "python" and not h.get("additional_dependencies") for h in hooks.values())
    configs = _readme_pre_commit_configs()
    assert len(configs) == 2
    local, remote = (config["repos"][0] for config in configs)
    assert local["repo"] == "local" and [h["id"] for h in local["hooks"]] == list(hooks)
    for hook in local["hooks"]:  # the same hooks, run by the graphslot installed with the engine
        assert hook["language"] == "system"
        assert {k: hook[k] for k in ("name", "entry", "files", "pass_filenames")} == {
            k: hooks[hook["id"]][k] for k in ("name", "entry", "files", "pass_filenames")}
    assert remote["rev"] == "<graphslot commit sha>" and [h["id"] for h in remote["hooks"]] == list(hooks)
    assert "any git ref, so pin the full sha of the graphslot commit" in " ".join(GENERATE_DOC.read_text().split())


def test_the_license_is_apache_2_and_ships_in_the_wheel_with_py_typed(tmp_path):
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.split("\n")[1].strip() == "Apache License"
    assert "Version 2.0, January 2004" in license_text and "END OF TERMS AND CONDITIONS" in license_text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert (REPO / "graphslot" / "py.typed").read_bytes() == b""
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["graphslot"]
    source = tmp_path / "src"
    source.mkdir()
    for name in ("graphslot", "pyproject.toml", "README.md", "LICENSE"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("graphslot-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "graphslot/py.typed" in names
    assert f"graphslot-{graphslot.__version__}.dist-info/licenses/LICENSE" in names


def test_python_3_10_gets_tomli():
    """tomllib is in the standard library from 3.11; 3.10 installs failed without tomli."""
    dependencies = PYPROJECT["project"]["dependencies"]
    assert "tomli>=1.1; python_version < '3.11'" in dependencies
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"


def test_the_package_imports_tomllib_in_one_place():
    importers = []
    for path in sorted((REPO / "graphslot").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if {"tomllib", "tomli"} & set(names):
                importers.append(path.relative_to(REPO).as_posix())
    assert sorted(set(importers)) == ["graphslot/spec/pyproject_text.py"]


def test_ci_runs_the_readme_test_command_then_ruff():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"Run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in lines and "ruff check graphslot tests benchmarks" in lines
    assert lines.index("ruff check graphslot tests benchmarks") > lines.index(command)
    assert any(re.match(r"ruff\b", d) for d in PYPROJECT["project"]["optional-dependencies"]["test"])
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py310"
    assert {"E9", "F"} <= set(PYPROJECT["tool"]["ruff"]["lint"]["select"])


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "graphslot", "tests", "benchmarks"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
