"""Graph replay vs eager step time on the reference model, decode and prefill.

    python benchmarks/bench_graph_speedup.py [--device cuda|cpu] [--quick] [--json PATH]

Decode: one DecodeGraphRunner (max_bs 32) timed at batch sizes 1, 8 and 32. Prefill:
the prefill runner captured breakable and piecewise, each on its own runtime, timed at
16, 64 and 256 tokens. Each figure is the median over rounds of the mean per-call time;
the graph side is the runner's whole step (``runner.replay``: fill + metadata + replay),
the eager side ``rt.forward``. Every case also checks that the runner's output matches eager (torch.equal on the
CPU tape backend where the matmul is batch-invariant, else allclose: see
graphslot/reference/numerics.py). Exits 1 if any check fails.

Only the runners' public surface is used (constructor, ``replay``, ``can_run``,
``buckets``, ``capture_seconds``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from graphslot.reference import TinyConfig, build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners.decode import DecodeGraphRunner
from graphslot.runners.prefill import PrefillGraphRunner

# Bigger than the tests' default (64 hidden, 2 layers) so the GPU has some work per
# kernel, yet small enough to stay launch-bound: that is where graphs pay off.
CONFIG = TinyConfig(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                    head_dim=32, intermediate_size=768, max_context_len=128)
MAX_REQS = 32
DECODE_SIZES = (1, 8, 32)
PREFILL_CASES = ((1, 16), (4, 64), (8, 256))  # (requests, total tokens); buckets match
#: The prefill runner's capture modes benchmarked.
PREFILL_CAPTURES = ("breakable", "piecewise")


class Timer:
    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.rounds = 3 if quick else 7
        self.round_s = 0.02 if quick else 0.2  # target length of one round

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _calibrate(self, fn: Callable[[], Any]) -> int:
        """Calls per round, from one timed call, so fast and slow cases cost about the same."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return max(3, min(500, int(self.round_s / max(time.perf_counter() - t0, 1e-6))))

    def _round_ms(self, fn: Callable[[], Any], iters: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters * 1e3

    def pair_ms(self, eager: Callable[[], Any], graph: Callable[[], Any]) -> tuple:
        """Median per-call ms of each, their rounds interleaved so that drift of the host
        (clocks, other load) hits both sides alike and their ratio stays honest."""
        for _ in range(3):  # warm-up: allocator, cuBLAS handles, lazy inits
            eager()
            graph()
        iters = (self._calibrate(eager), self._calibrate(graph))
        rounds: tuple = ([], [])
        for _ in range(self.rounds):
            for side, fn in enumerate((eager, graph)):
                rounds[side].append(self._round_ms(fn, iters[side]))
        return statistics.median(rounds[0]), statistics.median(rounds[1])


def agree(graph: torch.Tensor, eager: torch.Tensor) -> Dict[str, Any]:
    check = output_check(graph.device)
    diff = (graph - eager).abs().max().item() if graph.shape == eager.shape else float("inf")
    return {"match": check(graph, eager), "check": check.name, "max_abs_diff": diff}


def measure(timer: Timer, runner: Any, rt: Any, fb: Any) -> Dict[str, Any]:
    assert runner.can_run(fb), "the benchmark batch does not fit the runner"
    # Graph first, then eager: both write identical K/V into the batch's slots, so
    # repeating either on the same batch leaves the cache (and the outputs) unchanged.
    graph = runner.replay(fb).clone()  # replay returns views of static outputs
    row = agree(graph, rt.forward(fb))
    row["eager_ms"], row["graph_ms"] = timer.pair_ms(lambda: rt.forward(fb), lambda: runner.replay(fb))
    row["speedup"] = row["eager_ms"] / row["graph_ms"]
    return row


def bench_decode(timer: Timer, device: torch.device) -> Dict[str, Any]:
    rt = build_reference_model(CONFIG, device=device, max_num_reqs=MAX_REQS)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=max(DECODE_SIZES), progress=False)
    # Prefill MAX_REQS requests of mixed lengths so decode attends to real context.
    lens = [16 + (37 * i) % 80 for i in range(MAX_REQS)]
    rpi = rt.req_to_token_pool.alloc(MAX_REQS)
    prompts = [[(7 * i + j) % CONFIG.vocab_size for j in range(n)] for i, n in enumerate(lens)]
    for i in range(0, MAX_REQS, 8):  # in chunks: KV slots are allocated per batch anyway
        rt.forward(make_extend_batch(rt, rpi[i:i + 8], [0] * 8, prompts[i:i + 8]))
    rows = []
    for bs in DECODE_SIZES:
        fb = make_decode_batch(rt, rpi[:bs], lens[:bs], [(3 * i + 1) % CONFIG.vocab_size for i in range(bs)])
        rows.append({"batch_size": bs, **measure(timer, runner, rt, fb)})
    return {"capture_seconds": runner.capture_seconds, "rows": rows}


def prompt_lens(total: int, n: int) -> List[int]:
    """``n`` alternating short/long lengths summing to ``total`` (a ragged batch)."""
    base = total // n
    lens = [base + (base // 2) * (1 if i % 2 else -1) for i in range(n)]
    lens[-1] += total - sum(lens)
    return lens


def bench_prefill(timer: Timer, device: torch.device, capture: str) -> Dict[str, Any]:
    rt = build_reference_model(CONFIG, device=device, max_num_reqs=MAX_REQS)
    buckets = [tokens for _, tokens in PREFILL_CASES]
    runner = PrefillGraphRunner(ReferencePrefillAdapter(rt), capture=capture, token_buckets=buckets,
                                max_num_tokens=max(buckets), max_bs=max(bs for bs, _ in PREFILL_CASES), progress=False)
    rows = []
    for bs, tokens in PREFILL_CASES:
        rpi = rt.req_to_token_pool.alloc(bs)
        prompts = [[(5 * i + j) % CONFIG.vocab_size for j in range(n)]
                   for i, n in enumerate(prompt_lens(tokens, bs))]
        fb = make_extend_batch(rt, rpi, [0] * bs, prompts)
        rows.append({"batch_size": bs, "tokens": tokens, **measure(timer, runner, rt, fb)})
    return {"buckets": list(runner.buckets), "capture_seconds": runner.capture_seconds, "rows": rows}


def table(result: Dict[str, Any]) -> str:
    head = f"{'case':<32} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}  output"
    lines = [head, "-" * len(head)]

    def line(case: str, r: Dict[str, Any]) -> None:
        check = f"{r['check']} {'ok' if r['match'] else 'MISMATCH'} (max |d| {r['max_abs_diff']:.1e})"
        lines.append(f"{case:<32} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['speedup']:>7.2f}x  {check}")

    dec = result["decode"]
    for r in dec["rows"]:
        line(f"decode bs={r['batch_size']}", r)
    for name in ("breakable", "piecewise"):
        for r in result[name]["rows"]:
            line(f"prefill {name} {r['batch_size']}x -> {r['tokens']} tok", r)
    caps = ", ".join(f"{k} {result[k]['capture_seconds']:.2f} s" for k in ("decode", "breakable", "piecewise"))
    lines.append(f"capture: {caps}")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer, shorter timing rounds")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if device.type == "cpu":
        # As in `graphslot demo`: a model this small gains nothing from intra-op
        # threads, and spinning OpenMP workers make timings noisy.
        torch.set_num_threads(1)

    started = time.perf_counter()
    timer = Timer(device, args.quick)
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "graph_backend": "cuda graphs" if device.type == "cuda" else "cpu tape",
        "quick": args.quick,
        "config": {k: v for k, v in vars(CONFIG).items() if not isinstance(v, tuple)},
        "timing": {"rounds": timer.rounds, "round_s": timer.round_s,
                   "statistic": "median of round means, eager and graph rounds interleaved"},
    }
    print(f"device {result['device']} ({result['graph_backend']}), torch {result['torch']}", flush=True)
    result["decode"] = bench_decode(timer, device)
    for name in PREFILL_CAPTURES:
        result[name] = bench_prefill(timer, device, name)
    result["seconds"] = time.perf_counter() - started

    print(table(result))
    print(f"total {result['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    rows = result["decode"]["rows"] + result["breakable"]["rows"] + result["piecewise"]["rows"]
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
