"""Shared helpers for the test suite (kept small; add fixtures freely)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import pytest
import torch
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

import graphslot as gs
from graphslot.spec.loading import shipped_spec_path

TESTS_DIR = Path(__file__).resolve().parent
# Specs in the tests name hooks as 'hooks_for_tests:fn'. Make that module importable
# whatever pytest's import mode (prepend puts this folder on sys.path, importlib does not).
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# One intra-op thread, as in `graphslot demo`: the models here are tiny, and with
# several threads CPU kernels split work by size, so graph-vs-eager outputs could
# differ in the last bit (graphslot/reference/numerics.py) and no longer be compared
# with torch.equal.
torch.set_num_threads(1)

# Property tests draw the same examples on every run, wherever they run: "ci", the default
# profile (.ci/run names it too), so the README's test command finds what CI finds and
# nothing else, and a landing never depends on the draw. Drawing new examples (how they
# find bugs) is its own command, worth running before pushing a change to the spec layer
# or the generator: `HYPOTHESIS_PROFILE=explore python -m pytest tests/test_codegen_differential.py`
# (or the whole suite); new draws every run, and a failure found is kept in .hypothesis/
# and tried first the next time. "The same examples" holds for the same tests in the same
# order: hypothesis also draws constants from the project's modules already imported, so a
# subset, or another order, can draw others (tests/test_verify.py run first drew the example
# behind test_codegen_differential's source-hook test).
settings.register_profile("ci", derandomize=True, print_blob=True)
# The database is named: under a CI variable hypothesis's own "ci" defaults (no database)
# would otherwise carry into "explore".
settings.register_profile(
    "explore",
    derandomize=False,
    print_blob=True,
    database=DirectoryBasedExampleDatabase(str(TESTS_DIR.parent / ".hypothesis" / "examples")),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SPEC_FILE = "spec.yaml"  # the source label error lines name


def parse(text: str, source: str = SPEC_FILE) -> gs.RegistrySpec:
    """Parse (dedented) spec text."""
    return gs.parse_spec(textwrap.dedent(text), path=source)


def spec_error(text: str, source: str = SPEC_FILE) -> List[str]:
    """The error lines parsing ``text`` gives (the test fails if it parses cleanly)."""
    with pytest.raises(gs.SpecError) as info:
        parse(text, source)
    return str(info.value).splitlines()


def build_error(spec: Any, **kwargs: Any) -> List[str]:
    """The error lines building ``spec`` raises (interpreted mode; ``kwargs`` go to
    :func:`graphslot.api.build`, ``preset=`` included)."""
    from graphslot.api import build as build_full

    kwargs.setdefault("max_bs", 4)
    kwargs.setdefault("max_num_tokens", 8)
    with pytest.raises(gs.SpecError) as info:
        build_full(spec, impl="interpreted", **kwargs, device="cpu")
    return str(info.value).splitlines()


# The one-slot spec of make_slot_yaml: key -> value, in the order (and on the lines) written.
DEFAULT_SLOT = {"name": "x", "shape": ["max_bs"], "dtype": "int64", "axis": "bs", "padding": "zero"}


def make_slot_yaml(*, params: Optional[dict] = None, **keys: Any) -> str:
    """A spec with one slot: ``DEFAULT_SLOT`` updated by ``keys`` (``None`` drops a key).

    Without ``params`` the lines are fixed: 1 ``name: t``, 2 ``slots:``, 3 ``- name:``,
    4 shape, 5 dtype, 6 axis, 7 padding, then new keys from line 8 in the order given.
    ``params`` (a mapping) is written before ``slots`` as one flow mapping per param.
    """
    slot = dict(DEFAULT_SLOT)
    slot.update(keys)
    lines = ["name: t"]
    if params:
        lines.append("params:")
        lines += [f"  {name}: {json.dumps(value)}" for name, value in params.items()]
    lines.append("slots:")
    first = True
    for key, value in slot.items():
        if value is None:
            continue
        lines.append(f"{'  - ' if first else '    '}{key}: {json.dumps(value)}")
        first = False
    return "\n".join(lines) + "\n"


@dataclass
class Batch:
    """A minimal forward batch: the fields the shipped specs and the tests use."""

    batch_size: int = 0
    input_ids: Any = None
    positions: Any = None
    out_cache_loc: Any = None
    req_pool_indices: Any = None
    seq_lens: Any = None
    seq_lens_cpu: Any = None
    mrope_positions: Any = None
    num_token_non_padded: Any = None
    global_num_tokens_gpu: Any = None
    global_num_tokens_for_logprob_gpu: Any = None
    x: Any = None
    y: Any = None
    z: Any = None
    extra: Any = None


def build(text_or_spec: Any, max_bs: int = 4, max_num_tokens: int = 8, **kwargs: Any) -> gs.SlotRegistry:
    """An interpreted registry from spec text (dedented) or a RegistrySpec; ``kwargs``
    go to :func:`graphslot.api.build` (``pool=``, ``adopt=``, ``bind=``, ``strict=``...)."""
    from graphslot.api import build as build_full

    spec = parse(text_or_spec) if isinstance(text_or_spec, str) else text_or_spec
    return build_full(spec, device="cpu", max_bs=max_bs, max_num_tokens=max_num_tokens,
                      **{"impl": "interpreted", **kwargs})


# A slot an engine adds to a spec it started from the shipped decode spec (YAML lines to
# append to it).
LORA_IDS_SLOT = """\
  - name: lora_ids
    shape: [max_bs]
    dtype: int32
    axis: bs
    padding: zero
    index: true
"""
# How many slots the shipped specs hold (a project's decode adds LORA_IDS_SLOT to it).
DECODE_SLOTS = len(gs.load_spec(shipped_spec_path("decode")).slots)
PREFILL_SLOTS = len(gs.load_spec(shipped_spec_path("prefill")).slots)


def cli(capsys, *argv):
    """``graphslot ARGV`` in process: (exit status, stdout, stderr), never a traceback."""
    from graphslot.cli import main

    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


@pytest.fixture
def import_text(tmp_path, monkeypatch):
    """Write ``text`` as module ``gs_tmp_pkg.<name>`` under tmp_path and import it (a
    checked-in generated module, as an engine imports it)."""
    package = tmp_path / "gs_tmp_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = []

    def run(name: str, text: str) -> types.ModuleType:
        (package / f"{name}.py").write_text(text, encoding="utf-8")
        importlib.invalidate_caches()
        imported.append(f"gs_tmp_pkg.{name}")
        return importlib.import_module(f"gs_tmp_pkg.{name}")

    yield run
    for name in imported + ["gs_tmp_pkg"]:
        sys.modules.pop(name, None)
