"""What building a registry costs, the first time in a process and every time after.

    python benchmarks/bench_build_registry.py [--repeat N] [--json]

An engine (sglang's runner factories, a test suite) builds the same registry again and
again. The first build in a process reads, validates and compiles the spec; every later
build of the same spec and params must only allocate and bind its buffers: ``load_spec``
keeps validated files by (path, mtime, size), ``spec_from_dict`` keeps specs by their
data, resolved slots are kept per spec and params, and generated modules are compiled
once per (spec identity, baked params, skip set). Cases, each built ``--repeat`` times
after a first build (CPU, generated mode):

- ``decode``: the shipped spec by name, default params;
- ``decode, live providers``: with a new provider closure per build for the three
  ``live`` attention-TP params (what sglang's factories pass);
- ``decode from code``: ``spec_from_dict`` over ``load_spec("decode").to_dict()`` with
  ``absent_fields: skip``, derived again on every build;
- ``prefill, buffers=``: bound to the buffers of an earlier registry, with a
  ``context=`` factory;
- ``skip variant``: ``fill_from_skipping`` of a new registry (the variant was compiled
  by the first build).

``--slots N [N ...]``: the first build (generate, check, compile) of a generated registry
from a spec of N slots made in code (:func:`many_slots`), wall-clock and CPU time; it is
linear in N (issue 37: 4096 slots took 125 s, quadratic, before). On a 2-core machine
shared with other jobs: 256 slots 0.29 s CPU, 1024 1.1 s, 2048 2.4 s, 4096 5.1 s
(tests/test_build_scaling.py checks the ratio).

The figures are wall-clock times on this machine (median and 90th percentile); they
vary with its load. No assertion is made here: a unit test checks only that nothing is
compiled again (tests/test_sglang_core.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import graphslot as gs
from graphslot.spec.hooks import FillContext
from graphslot.api import build

MAX_BS, MAX_NUM_TOKENS = 64, 256
STAGED = frozenset({"positions", "out_cache_loc", "req_pool_indices", "seq_lens"})


def _providers() -> Dict[str, Any]:
    return {"attn_tp_sharded": lambda ctx: False, "attn_tp_rank": lambda ctx: 0, "attn_tp_size": lambda ctx: 1}


def _decode_from_code() -> gs.SlotRegistry:
    data = gs.load_spec("decode").to_dict()
    data["absent_fields"] = "skip"
    spec = gs.spec_from_dict(data, label="<code: bench decode>")
    return gs.build_registry(spec, max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, params=_providers(), device="cpu")


def many_slots(n: int, tag: str = "") -> gs.RegistrySpec:
    """A spec of ``n`` slots of four dtypes, both axes, zero and sentinel pads, some
    optional; ``tag`` makes a new spec (nothing cached) of the same shape."""
    dtypes = ("int64", "int32", "float32", "bfloat16")
    slots = [{"name": f"s{i}", "shape": ["max_bs"] if i % 3 else ["max_num_tokens", 2], "dtype": dtypes[i % 4],
              "axis": "bs" if i % 3 else "tokens", "padding": "zero" if i % 2 else "fill_sentinel",
              **({} if i % 2 else {"pad_value": 1}), **({"optional": True} if i % 5 == 0 else {})}
             for i in range(n)]
    return gs.spec_from_dict({"name": f"many{n}{tag}", "slots": slots})


def first_build_of_many(n: int) -> Dict[str, float]:
    """Wall-clock and CPU seconds of the first generated build of an ``n``-slot spec."""
    spec = many_slots(n, "_bench")
    wall, cpu = time.perf_counter(), time.process_time()
    gs.build_registry(spec, max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, device="cpu")
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def cases() -> Dict[str, Callable[[], Any]]:
    owner = gs.build_registry("prefill", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, device="cpu")
    given = {slot.name: slot.buffer for slot in owner.active}
    return {
        "decode": lambda: gs.build_registry("decode", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, device="cpu"),
        "decode, live providers": lambda: gs.build_registry("decode", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS,
                                                            params=_providers(), device="cpu"),
        "decode from code": _decode_from_code,
        "prefill, buffers=": lambda: build("prefill", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, buffers=given,
                                                       context=FillContext, device="cpu"),
        "skip variant": lambda: gs.build_registry("decode", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS,
                                                  device="cpu").fill_from_skipping(STAGED),
    }


def measure(build: Callable[[], Any], repeat: int) -> Dict[str, float]:
    start = time.perf_counter()
    build()
    first = time.perf_counter() - start
    times: List[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        build()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"first_ms": first * 1e3, "median_ms": statistics.median(times) * 1e3,
            "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="builds measured per case after the first")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--slots", type=int, nargs="+", metavar="N",
                        help="instead: the first build of a generated registry from an N-slot spec")
    args = parser.parse_args(argv)
    if args.slots:
        # imports and templates, not measured
        gs.build_registry("decode", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, device="cpu")
        many = {n: first_build_of_many(n) for n in args.slots}
        if args.json:
            print(json.dumps(many, indent=2))
        for n, r in ([] if args.json else many.items()):
            print(f"{n:>6} slots: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU (first build, generated)")
        return 0
    start = time.perf_counter()
    # imports, the first parse and compile
    gs.build_registry("decode", max_bs=MAX_BS, max_num_tokens=MAX_NUM_TOKENS, device="cpu")
    results = {"first build in the process (ms)": (time.perf_counter() - start) * 1e3}
    results.update({name: measure(build, max(args.repeat, 1)) for name, build in cases().items()})
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"first build in the process: {results.pop('first build in the process (ms)'):.1f} ms "
          f"(imports, parse, validate, compile)")
    print(f"{'case':<24} {'first':>9} {'median':>9} {'p90':>9}   (ms, max_bs={MAX_BS}, "
          f"max_num_tokens={MAX_NUM_TOKENS}, {args.repeat} builds)")
    for name, r in results.items():
        print(f"{name:<24} {r['first_ms']:>9.3f} {r['median_ms']:>9.3f} {r['p90_ms']:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
