"""The Python examples of docs/sglang.md run as written (CPU, sglang loaded as the suite
loads it) and their asserts hold; its tables name the patch table and tests that exist."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

import sglang_loader
from test_docs import python_blocks

try:
    sglang_loader.load()
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"sglang's buffer registry cannot be imported: {exc}", allow_module_level=True)

import graphslot.integrations.sglang as gs_sglang

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "sglang.md"


def test_every_python_block_runs_in_order(monkeypatch):
    blocks = python_blocks(PAGE)
    assert len(blocks) >= 2 and all(re.search(r"^\s*assert ", code, re.M) for _, code in blocks)
    module = types.ModuleType("docs_sglang")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        for line, code in blocks:
            try:
                exec(compile("\n" * (line - 1) + code, str(PAGE), "exec"), module.__dict__)
            except Exception as exc:  # noqa: BLE001 - re-raised with where it happened
                pytest.fail(f"docs/sglang.md: the python block at line {line} failed: {type(exc).__name__}: {exc}")
    finally:
        gs_sglang.uninstall()


def test_the_patch_table_on_the_page_is_the_one_installed():
    text = PAGE.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `((?:runner\.)?[a-z_]+)`[^|]*\| ([^|]+) \|$", text, re.M)
    page = {f"sglang.srt.model_executor.{module}": tuple(re.findall(r"`(\w+)`", names)) for module, names in rows}
    assert page == dict(gs_sglang.PATCH_TABLE)


def test_every_test_the_differences_table_names_exists():
    text = PAGE.read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", text))
    defined = set()
    for path in ROOT.glob("tests/test_sglang_dropin*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    assert len(named) >= 12 and named <= defined, sorted(named - defined)
