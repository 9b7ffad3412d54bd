"""Building a generated registry is linear in the spec's slots (issue 37): 4096 slots
took 125 s, quadratic through a sort keyed by ``list.index`` (2M dataclass ``__eq__``
calls), a regex over the whole generated text per slot, and a linear search per slot
for its spec. CPU time (not wall-clock, which other processes inflate) of a 2048-slot
build against a 256-slot one: 8x for linear, 64x for quadratic; a 4096-slot build
against it: 16x for linear (31x measured), 256x for quadratic: a margin for a loaded machine."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import graphslot as gs

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_build_registry.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_build_registry", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


many_slots = _bench().many_slots


def build_seconds(n: int, tag: str) -> float:
    spec = many_slots(n, tag)  # validated outside the measure: the generated build is what scales
    start = time.process_time()
    reg = gs.build_registry(spec, max_bs=4, max_num_tokens=8, device="cpu")
    seconds = time.process_time() - start
    assert reg.impl == "generated" and len(reg.active) == n
    return seconds


def test_a_generated_build_is_linear_in_the_slots():
    small = min(build_seconds(256, tag) for tag in "ab")
    large = build_seconds(4096, "a")
    # linear: 16x (measured 31x: compiling one long function is a little superlinear);
    # quadratic: 256x (the old code took 125 s at 4096 slots)
    assert large / small < 100, f"256 slots: {small:.2f} s, 4096 slots: {large:.2f} s (x{large / small:.1f})"
