"""Cost of the replay guard (GRAPHSLOT_DEBUG=1) per decode replay, on the reference model.

Two runners over two identical reference models, one with the guard: the same padded batch is
replayed in interleaved rounds; the median per-replay time of each and of the guard's
check alone are printed (µs). ``python benchmarks/bench_guard.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner


def per_call_us(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def run(iters: int = 300, rounds: int = 7, device: str = "cpu") -> dict:
    torch.set_num_threads(1)
    runners, batches = [], []
    for guard in (False, True):  # one model each: a runner owns its adapter's graph state
        rt = build_reference_model(device=device, max_num_reqs=8)
        runners.append(DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=8, progress=False, guard=guard))
        rpi = rt.req_to_token_pool.alloc(5)
        rt.forward(make_extend_batch(rt, rpi, [0] * 5, [[i + 1, i + 2] for i in range(5)]))
        batches.append(make_decode_batch(rt, rpi, [2] * 5, [3] * 5))  # 5 -> padded 8
    (plain, guarded), (fb, guarded_fb) = runners, batches
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples = {"replay_us": [], "guarded_replay_us": [], "check_us": []}
    for _ in range(rounds):
        samples["replay_us"].append(per_call_us(lambda: (plain.replay(fb), sync()), iters))
        samples["guarded_replay_us"].append(per_call_us(lambda: (guarded.replay(guarded_fb), sync()), iters))
        samples["check_us"].append(per_call_us(guarded.guard.check, iters * 10))
    result = {k: statistics.median(v) for k, v in samples.items()}
    result["guarded_tensors"] = len(guarded.guard._expected)
    result["device"], result["torch"] = device, torch.__version__
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    r = run(device=args.device)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{args.device}, torch {r['torch']}: replay {r['replay_us']:.1f} µs, with the guard "
              f"{r['guarded_replay_us']:.1f} µs; check alone {r['check_us']:.2f} µs "
              f"over {r['guarded_tensors']} tensors")
