"""Packaging: the toolchain installs without torch, and the release instructions name the
release that is being made."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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


def test_pre_commit_instructions_name_this_release():
    hooks_file = (REPO / ".pre-commit-hooks.yaml").read_text()
    tag = f"v{graphslot.__version__}"
    assert f"rev: {tag}" in hooks_file
    assert f"rev: {tag}" in (REPO / "README.md").read_text()
    # Every hook runs a command of the torch-free toolchain (tests/test_torch_free.py).
    hooks = yaml.safe_load(hooks_file)
    assert {h["entry"] for h in hooks} == {"graphslot validate", "graphslot generate --check"}
    assert all(h["language"] == "python" and not h.get("additional_dependencies") for h in hooks)


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
