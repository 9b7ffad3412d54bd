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

MAX_BS, MAX_NUM_TOKENS = 64, 256
STAGED = frozenset({"positions", "out_cache_loc", "req_pool_indices", "seq_lens"})


def _providers() -> Dict[str, Any]:
    return {"attn_tp_sharded": lambda ctx: False, "attn_tp_rank": lambda ctx: 0, "attn_tp_size": lambda ctx: 1}


def _decode_from_code() -> gs.SlotRegistry:
    data = gs.load_spec("decode").to_dict()
    data["absent_fields"] = "skip"
    spec = gs.spec_from_dict(data, source="<code: bench decode>")
    return gs.build_registry(spec, MAX_BS, MAX_NUM_TOKENS, params=_providers())


def cases() -> Dict[str, Callable[[], Any]]:
    owner = gs.build_registry("prefill", MAX_BS, MAX_NUM_TOKENS)
    given = {slot.name: slot.buffer for slot in owner.active}
    return {
        "decode": lambda: gs.build_registry("decode", MAX_BS, MAX_NUM_TOKENS),
        "decode, live providers": lambda: gs.build_registry("decode", MAX_BS, MAX_NUM_TOKENS, params=_providers()),
        "decode from code": _decode_from_code,
        "prefill, buffers=": lambda: gs.build_registry("prefill", MAX_BS, MAX_NUM_TOKENS, buffers=given,
                                                       context=FillContext),
        "skip variant": lambda: gs.build_registry("decode", MAX_BS, MAX_NUM_TOKENS).fill_from_skipping(STAGED),
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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    gs.build_registry("decode", MAX_BS, MAX_NUM_TOKENS)  # imports, the first parse and compile
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
