"""Host time of a DP decode step with one collective (the default) and with two (the
replay guard's debugging mode: a second all-gather after prepare, the old protocol), on
two gloo ranks over localhost and the reference model (CPU tape graphs).

Each rank replays the same batch (rank 0: 3 requests, rank 1: 5; both pad to 8) in
interleaved rounds of both modes on one runner (``DPDecodeRunner.confirm``); rank 0's
median per-step time of each mode, their ratio, and ``SlotRegistry.check_step`` alone
(the check the one-collective step adds before its exchange) are printed (µs), all
measured in one run. ``python benchmarks/bench_dp_step.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict

import torch

REQUESTS = (3, 5)


def per_call_us(fn: Any, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def rank_timings(rank: int, world_size: int, iters: int, rounds: int) -> Dict[str, Any]:
    from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
    from graphslot.reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from graphslot.runners import DPDecodeRunner, DPExchange

    torch.set_num_threads(1)
    rt = build_reference_model(max_num_reqs=8)
    dp = DPDecodeRunner(ReferenceDPDecodeAdapter(rt, DPAttention()), DPExchange(), max_bs=8, progress=False,
                        guard=False)
    n = REQUESTS[rank]
    rpi = rt.req_to_token_pool.alloc(n)
    rt.forward(make_extend_batch(rt, rpi, [0] * n, [[i + 1, i + 2] for i in range(n)]))
    fb = make_decode_batch(rt, rpi, [2] * n, [3] * n)
    samples: Dict[str, list] = {"one_collective_us": [], "two_collectives_us": [], "check_step_us": []}
    for _ in range(rounds):  # every rank runs the same modes in the same order: their steps stay matched
        for confirm, key in ((False, "one_collective_us"), (True, "two_collectives_us")):
            dp.confirm = confirm
            samples[key].append(per_call_us(lambda: dp(fb), iters))
        samples["check_step_us"].append(per_call_us(
            lambda: dp.runner.registry.check_step(fb, raw_bs=n, raw_num_tokens=n), iters * 10))
    assert dp.last.padded_bs == 8 and dp.graph_steps == 2 * iters * rounds
    return {key: statistics.median(values) for key, values in samples.items()}


def run(iters: int = 200, rounds: int = 5) -> Dict[str, Any]:
    from graphslot.reference.dp_launch import launch

    result = launch(rank_timings, len(REQUESTS), iters, rounds, timeout=600.0)[0]
    result["ratio"] = result["one_collective_us"] / result["two_collectives_us"]
    result["torch"] = torch.__version__
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    r = run(args.iters, args.rounds)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"2 gloo ranks, CPU tape, torch {r['torch']}: DP graph step {r['one_collective_us']:.1f} µs with one "
              f"collective, {r['two_collectives_us']:.1f} µs with two (ratio {r['ratio']:.2f}); "
              f"check_step alone {r['check_step_us']:.2f} µs")
