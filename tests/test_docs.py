"""The Python examples of docs/engine.md run as written (on the CPU) and their asserts hold.

The page's ```python blocks are run in order in one namespace, as a reader would paste
them one after another; each block is its own test step, so a failure names the block
and the line in the page. A block whose first line is ``# some/path.py: ...`` is a whole
file of a project (:func:`file_blocks`): it runs the same, and need not assert (the
blocks after it do; ``tests/test_scratch_engine.py`` writes it to a project and runs
the CLI on it).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
FILE_LINE = re.compile(r"# ([\w./]+\.py):")


def python_blocks(path: Path):
    """``(first line in the page, code)`` of every ```python block, in order."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(PAGE)


def file_blocks(path: Path = PAGE):
    """``{relative path: code}`` of the blocks that are whole files."""
    return {m.group(1): code for _, code in python_blocks(path) if (m := FILE_LINE.match(code))}


def test_the_page_has_examples_that_assert_something():
    assert len(BLOCKS) >= 6
    asserts = sum(len(re.findall(r"^\s*assert ", code, re.M)) for _, code in BLOCKS)
    assert asserts >= 20
    # every block but the tiny ones shows a result
    assert all(re.search(r"^\s*assert ", code, re.M) for _, code in BLOCKS if not FILE_LINE.match(code))
    assert list(file_blocks()) == ["myengine/engine.py"]


def test_every_python_block_runs_in_order(monkeypatch):
    # The page shows non-strict behaviour (a silent int32 -> int64 cast) next to strict
    # mode, so the environment must not switch strict mode on for every registry.
    monkeypatch.delenv("GRAPHSLOT_STRICT", raising=False)
    # A real module: dataclasses defined on the page look their module up in sys.modules.
    module = types.ModuleType("docs_engine")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for line, code in BLOCKS:
        # Pad so that a traceback's line numbers are the page's.
        source = "\n" * (line - 1) + code
        try:
            exec(compile(source, str(PAGE), "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - re-raised with where it happened
            pytest.fail(f"docs/engine.md: the python block at line {line} failed: "
                        f"{type(exc).__name__}: {exc}")


def test_the_readme_tour_spec_is_a_valid_spec_whose_slots_match_the_shipped_decode():
    """The README's YAML is a spec as written, and says of each slot what the shipped one says."""
    import graphslot as gs

    readme = (PAGE.parent.parent / "README.md").read_text(encoding="utf-8")
    (text,) = re.findall(r"^```yaml\n(.*?)^```$", readme, re.S | re.M)
    tour, shipped = gs.parse_spec(text, "README.md"), gs.load_spec("decode")
    assert len(tour.slots) == 2
    for slot in tour.slots:
        ours = next(s for s in shipped.slots if s.name == slot.name)
        assert slot.model_dump(exclude={"description"}) == ours.model_dump(exclude={"description"}), slot.name
