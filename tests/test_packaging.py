"""Packaging: the toolchain installs without torch, and the release instructions name the
release that is being made."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

import graphslot

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
