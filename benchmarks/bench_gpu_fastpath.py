"""GPU fast path (issue 14): fill launches, the step's host gap, capture time and memory.

    python benchmarks/bench_gpu_fastpath.py [--smoke] [--json PATH]

One run prints:

a. fill: host µs per ``fill_from`` + ``extract`` (shipped decode spec, max_bs 256,
   reference ``ForwardBatch``es) generated vs interpreted, and per fill the ops that
   write device buffers (dispatch mode) and, on CUDA, the kernels launched
   (``torch.profiler``: runtime launch calls and GPU kernel/memset/memcpy events);
b. the step's host gap: a steady decode loop through ``DecodeGraphRunner`` on a
   1B-shape reference model at bs 1, 32 and 256. GPU period per step (CUDA events
   around N back-to-back steps) minus the graph's own GPU time (N back-to-back
   ``graph.replay()``) is the time the GPU is not running the graph (idle + the fill's
   and metadata's kernels); and the host µs of ``runner.replay()`` minus
   ``graph.replay()`` (each call timed from an idle queue); and the GPU period per step
   with ``share_outputs`` (the graph's copy into the shared output buffers included);
c. capture economics: all default decode sizes up to 256 of the same model, one
   subprocess per variant (a clean allocator each): seconds, and
   ``memory_allocated``/``memory_reserved`` growth per size and in total, split into
   the graphs' shared pool (reserved, in use, and the bytes the graphs' static outputs
   keep alive there) and what the allocator reserved outside it (warm-up activations);
   variants: warm-up before every size, before the first only, and that with
   ``share_outputs`` (one set of output buffers for all sizes).

``--smoke``: tiny model, few sizes, CPU tape backend; CUDA-only figures are n/a. Only
public runner APIs and torch (<= 2.11) are used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch
from torch.utils._pytree import tree_leaves

import graphslot as gs
from graphslot.cli.fill_bench import count_device_ops
from graphslot.reference import TinyConfig, build_reference_model, make_decode_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner
from graphslot.runners.dispatch import capture_sizes

# Llama-3.2-1B's shape (random weights): hidden 2048, 16 layers, 32 heads, 8 KV heads.
CONFIG_1B = TinyConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                       head_dim=64, intermediate_size=8192, max_context_len=64, rope_theta=500000.0)
CONFIG_SMOKE = TinyConfig()
VARIANTS = {"warmup-all": {"warmup_sizes": "all"}, "warmup-largest": {"warmup_sizes": "largest"},
            "shared-outputs": {"warmup_sizes": "largest", "share_outputs": True}}
NA = None  # a figure this device cannot give


def setup(smoke: bool) -> SimpleNamespace:
    cuda = torch.cuda.is_available() and not smoke
    return SimpleNamespace(
        smoke=smoke, cuda=cuda, device=torch.device("cuda" if cuda else "cpu"),
        dtype=torch.bfloat16 if cuda else torch.float32, config=CONFIG_SMOKE if smoke else CONFIG_1B,
        max_bs=8 if smoke else 256, fill_sizes=(1, 3, 8) if smoke else (1, 3, 30, 100, 200, 256),
        gap_sizes=(1, 4, 8) if smoke else (1, 32, 256), iters=10 if smoke else 300)


def sync(s) -> None:
    if s.cuda:
        torch.cuda.synchronize()


def decode_fb(rt, bs: int):
    """A reference decode batch of ``bs`` requests (one new token each)."""
    ctx = rt.config.max_context_len
    return make_decode_batch(rt, list(range(1, bs + 1)), [(7 * i) % (ctx - 2) + 1 for i in range(bs)],
                             [(13 * i) % rt.config.vocab_size for i in range(bs)])


def host_us(fn, iters: int, s) -> float:
    """Median host µs of ``fn`` over rounds of ``iters`` calls (the GPU keeps up)."""
    rounds = []
    for _ in range(5):
        sync(s)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
    sync(s)
    return statistics.median(rounds)


def each_call_us(fn, iters: int, s) -> float:
    """Median host µs of one call started on an idle device queue."""
    samples = []
    for _ in range(3):  # first calls: lazy inits, plan caches
        fn()
    for _ in range(iters):
        sync(s)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    sync(s)
    return statistics.median(samples)


def cuda_launches(fn, s) -> Optional[Dict[str, int]]:
    """Kernel launches of one ``fn()`` on CUDA: runtime launch calls and GPU events."""
    if not s.cuda:
        return NA
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(s)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(s)
    events = prof.events()
    launches = sum(1 for e in events if "LaunchKernel" in e.name or "GraphLaunch" in e.name)
    gpu = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"launch_calls": launches, "gpu_events": gpu}


# -- a. fill ----------------------------------------------------------------------------
def bench_fill(s, rt) -> List[Dict[str, Any]]:
    ladder = sorted(capture_sizes(256 if not s.smoke else s.max_bs))
    regs = {mode: gs.build_registry("decode", max_bs=s.max_bs, max_num_tokens=s.max_bs, device=s.device, impl=mode,
                                    params={"seq_len_fill_value": 1}) for mode in ("generated", "interpreted")}
    rows = []
    for raw in s.fill_sizes:
        padded = next(b for b in ladder if b >= raw)
        fb = decode_fb(rt, raw)
        row: Dict[str, Any] = {"raw": raw, "padded": padded}
        for mode, reg in regs.items():
            def step(reg=reg, p=padded):
                reg.fill_from(fb, raw_bs=raw, padded_bs=p, raw_num_tokens=raw, padded_num_tokens=p)
                reg.extract(fb, padded_bs=p, padded_num_tokens=p)
            row[f"{mode}_us"] = host_us(step, s.iters * 10, s)
            row[f"{mode}_device_ops_padded"] = len(count_device_ops(reg, fb, raw, padded, raw, padded))
            row[f"{mode}_device_ops_unpadded"] = len(count_device_ops(reg, fb, raw, raw, raw, raw))
            row[f"{mode}_launches_padded"] = cuda_launches(
                lambda: reg.fill_from(fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw,
                                      padded_num_tokens=padded), s)
            row[f"{mode}_launches_unpadded"] = cuda_launches(
                lambda: reg.fill_from(fb, raw_bs=raw, padded_bs=raw, raw_num_tokens=raw, padded_num_tokens=raw), s)
        row["speedup"] = row["interpreted_us"] / row["generated_us"]
        rows.append(row)
    return rows


# -- b. the step's host gap ---------------------------------------------------------------
def gpu_ms_per_call(fn, iters: int, s) -> Optional[float]:
    if not s.cuda:
        return NA
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    sync(s)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync(s)
    return start.elapsed_time(end) / iters


def gap_rows(s, rt, runner: DecodeGraphRunner) -> List[Dict[str, Any]]:
    """One row per batch size: the step's device time, the graph's alone, and the host side."""
    rows = []
    for bs in s.gap_sizes:
        fb = decode_fb(rt, bs)
        graph = runner.graph(runner.padded_bs(fb))

        def step(fb=fb):
            return runner.replay(fb)

        step_ms = gpu_ms_per_call(step, s.iters, s)
        graph_ms = gpu_ms_per_call(graph.replay, s.iters, s)
        replay_us = each_call_us(step, s.iters, s)
        launch_us = each_call_us(graph.replay, s.iters, s)
        rows.append({
            "bs": bs, "step_gpu_ms": step_ms, "graph_gpu_ms": graph_ms,
            "gap_us": NA if step_ms is None else max(0.0, (step_ms - graph_ms) * 1e3),
            "replay_host_us": replay_us, "graph_replay_host_us": launch_us, "prep_host_us": replay_us - launch_us,
            "launches_per_step": cuda_launches(step, s)})
    return rows


def bench_gap(s, rt) -> List[Dict[str, Any]]:
    def runner(share_outputs: bool) -> DecodeGraphRunner:
        return DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=max(s.gap_sizes), capture_bs=list(s.gap_sizes),
                                 progress=False, share_outputs=share_outputs)

    # One runner per model at a time: a runner's graph state (the attention backend's
    # static buffers) replaces the previous runner's, so the plain runner is gone (no
    # name holds it once gap_rows returns) before the shared one is built.
    rows = gap_rows(s, rt, runner(False))
    shared = runner(True)
    for row in rows:
        fb = decode_fb(rt, row["bs"])
        row["shared_outputs_step_gpu_ms"] = gpu_ms_per_call(lambda: shared.replay(fb), s.iters, s)  # + the copy
    return rows


# -- c. capture economics (one subprocess per variant) -------------------------------------
class MeteredAdapter(ReferenceDecodeAdapter):
    """Notes the allocator's figures just before each size's capture."""

    def __init__(self, runtime, marks: List[Dict[str, Any]]):
        super().__init__(runtime)
        self.marks = marks

    def init_capture_metadata(self, bs, num_tokens, view):
        self.marks.append({"bs": bs, **memory(self.device)})
        super().init_capture_metadata(bs, num_tokens, view)


def memory(device) -> Dict[str, Optional[int]]:
    if device.type != "cuda":
        return {"allocated": NA, "reserved": NA}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def capture_variant(smoke: bool, variant: str) -> Dict[str, Any]:
    s = setup(smoke)
    rt = build_reference_model(s.config, s.device, s.dtype, max_num_reqs=s.max_bs)
    marks: List[Dict[str, Any]] = []
    before = memory(s.device)
    t0 = time.perf_counter()
    runner = DecodeGraphRunner(MeteredAdapter(rt, marks), max_bs=s.max_bs, progress=False, **VARIANTS[variant])
    seconds = time.perf_counter() - t0
    after = memory(s.device)
    per_size = []
    for mark, nxt in zip(marks, marks[1:] + [after]):
        per_size.append({"bs": mark["bs"], **{k: NA if mark[k] is None else nxt[k] - mark[k] for k in after}})
    total = {k: NA if before[k] is None else after[k] - before[k] for k in after}
    return {"variant": variant, "sizes": len(runner.captured_sizes), "runner_capture_s": runner.capture_seconds,
            "construct_s": seconds, "total": total, "per_size": per_size,
            "outputs_held": outputs_held(runner), "pool": pool_segments(runner.backend)}


def outputs_held(runner) -> int:
    """Bytes of the storages the graphs' static outputs keep alive, each counted once."""
    storages = {}
    for graph in runner.graphs.values():
        for leaf in tree_leaves(graph.output):
            if isinstance(leaf, torch.Tensor):
                storages[leaf.untyped_storage().data_ptr()] = leaf.untyped_storage().nbytes()
    return sum(storages.values())


def pool_segments(backend) -> Dict[str, Optional[int]]:
    """The graphs' shared pool in the CUDA allocator: bytes reserved and in use."""
    if getattr(backend, "name", None) != "cuda" or backend.pool is None:
        return {"reserved": NA, "allocated": NA}
    pool = tuple(backend.pool)
    mine = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", ())) == pool]
    return {"reserved": sum(seg["total_size"] for seg in mine),
            "allocated": sum(seg["allocated_size"] for seg in mine)}


def bench_capture(s, timeout: float) -> List[Dict[str, Any]]:
    results = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "capture.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--capture-variant", variant, "--out", out]
            cmd += ["--smoke"] if s.smoke else []
            root = os.path.dirname(os.path.dirname(os.path.abspath(gs.__file__)))  # the graphslot imported here
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            if proc.returncode != 0:
                results.append({"variant": variant, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            with open(out) as f:
                results.append(json.load(f))
    return results


# -- report -----------------------------------------------------------------------------
def fmt(value, spec=".1f", unit="") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def report(result: Dict[str, Any]) -> str:
    lines = [f"graphslot GPU fast path: device {result['device_name']}, torch {result['torch']}"
             + (" (smoke)" if result["smoke"] else ""),
             "a. fill_from + extract, decode spec, max_bs %d" % result["max_bs"],
             "   raw/padded  generated  interpreted  ratio  dev ops gen pad/unpad (int)  launches gen pad/unpad (int)"]
    for r in result["fill"]:
        def la(mode, r=r):
            p, u = r[f"{mode}_launches_padded"], r[f"{mode}_launches_unpadded"]
            return "n/a" if p is None else f"{p['gpu_events']}/{u['gpu_events']}"
        lines.append(f"   {r['raw']:>4}/{r['padded']:<4}  {r['generated_us']:8.2f}µs  {r['interpreted_us']:9.2f}µs  "
                     f"{r['speedup']:5.2f}x  {r['generated_device_ops_padded']}/{r['generated_device_ops_unpadded']} "
                     f"({r['interpreted_device_ops_padded']}/{r['interpreted_device_ops_unpadded']})"
                     f"{'':14}{la('generated')} ({la('interpreted')})")
    lines.append("b. steady decode through DecodeGraphRunner (%s)" % result["model"])
    lines.append("   bs  step GPU  graph GPU  gap (GPU not in graph)  replay host  graph.replay host  prep host"
                 "  step GPU, shared outputs")
    for r in result["gap"]:
        lines.append(f"   {r['bs']:>3}  {fmt(r['step_gpu_ms'], '.3f', 'ms'):>8}  "
                     f"{fmt(r['graph_gpu_ms'], '.3f', 'ms'):>9}  "
                     f"{fmt(r['gap_us'], '.1f', 'µs'):>22}  {r['replay_host_us']:9.1f}µs  "
                     f"{r['graph_replay_host_us']:15.1f}µs  {r['prep_host_us']:7.1f}µs"
                     f"  {fmt(r['shared_outputs_step_gpu_ms'], '.3f', 'ms'):>24}")
    lines.append("c. capture, all default decode sizes (one subprocess per variant)")
    for c in result["capture"]:
        if "error" in c:
            lines.append(f"   {c['variant']}: failed: {c['error']}")
            continue
        t = c["total"]
        lines.append(f"   {c['variant']}: {c['sizes']} sizes in {c['runner_capture_s']:.2f} s; allocated "
                     f"+{gib(t['allocated'])}, reserved +{gib(t['reserved'])}")
        pool = c["pool"]
        outside = NA if pool["reserved"] is None else t["reserved"] - pool["reserved"]
        lines.append(f"     graphs' pool: reserved {mib(pool['reserved'])}, in use {mib(pool['allocated'])}; "
                     f"the graphs' outputs hold {mib(c['outputs_held'])}; reserved outside the pool +{mib(outside)}")
        worst = sorted((p for p in c["per_size"] if p["reserved"] is not None), key=lambda p: -p["reserved"])[:5]
        if worst:
            lines.append("     largest reserved growth: " + ", ".join(
                f"bs {p['bs']} +{p['reserved'] / 2**20:.0f} MiB (alloc +{p['allocated'] / 2**20:.0f})" for p in worst))
    capture = [c for c in result["capture"] if "error" not in c]
    for other in capture[1:]:
        base = capture[0]
        line = (f"   {other['variant']} vs {base['variant']}: capture time "
                f"{base['runner_capture_s'] / other['runner_capture_s']:.2f}x faster")
        if base["total"]["reserved"] is not None and other["total"]["reserved"] > 0:
            line += f", reserved growth {base['total']['reserved'] / other['total']['reserved']:.2f}x smaller"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU tape backend (CI)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure here")
    ap.add_argument("--capture-variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.capture_variant:
        with open(args.out, "w") as f:
            json.dump(capture_variant(args.smoke, args.capture_variant), f)
        return 0
    s = setup(args.smoke)
    torch.manual_seed(0)
    print(f"bench_gpu_fastpath: {'smoke, ' if s.smoke else ''}device {s.device}", file=sys.stderr)
    rt = build_reference_model(s.config, s.device, s.dtype, max_num_reqs=s.max_bs)
    result = {"smoke": s.smoke, "device": str(s.device), "torch": torch.__version__, "max_bs": s.max_bs,
              "device_name": torch.cuda.get_device_name() if s.cuda else "cpu",
              "model": f"hidden {s.config.hidden_size}, {s.config.num_layers} layers, vocab {s.config.vocab_size}, "
                       f"{str(s.dtype).replace('torch.', '')}"}
    result["fill"] = bench_fill(s, rt)
    print("bench_gpu_fastpath: fill timed", file=sys.stderr)
    result["gap"] = bench_gap(s, rt)
    del rt
    if s.cuda:
        torch.cuda.empty_cache()
    print("bench_gpu_fastpath: gap timed; capture variants next", file=sys.stderr)
    result["capture"] = bench_capture(s, timeout=60 if s.smoke else 150)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
