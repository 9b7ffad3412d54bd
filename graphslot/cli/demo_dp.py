"""``graphslot demo --dp N``: DP-attention decode across N spawned ranks vs one process.

Each rank runs its own continuous-batching scheduler (its own requests, so its own
batch size every step) and decodes through :class:`~graphslot.runners.dp.DPDecodeRunner`
on the DP reference model: the ranks exchange their token counts, agree on one graph
(or on eager, when a rank is beyond the largest captured size) and gather each
other's hidden states inside it. Prefill stays local and eager. Every rank's logits of
every step are then checked, in this process, against the same requests run through
the plain (non-DP) reference model in one process, which also samples the ranks'
tokens so both runs see the same inputs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from ..log import progress_bar
from ..reference import Scheduler, TinyConfig, build_reference_model
from ..reference.dp_launch import launch
from ..reference.numerics import output_check
from .common import metric_table
from .demo_common import single_thread, timed

#: How far beyond the largest graph the last rank's batches may grow, so that some
#: steps must fall back to eager on every rank; its sparser arrivals keep that rare.
OVERFLOW = 2
ARRIVAL_GAP = 2
LAST_RANK_ARRIVAL_GAP = 4
#: Seconds a whole run may take before its ranks are killed (a hang in a collective).
DEFAULT_TIMEOUT = 600.0


def dp_device(backend: str, dp: int) -> torch.device:
    """``auto``: NCCL over GPUs when there is one per rank, else gloo on the CPU."""
    cuda = backend == "cuda" or (backend == "auto" and torch.cuda.device_count() >= dp)
    return torch.device("cuda" if cuda else "cpu")


def _scheduler(runtime: Any, rank: int, dp: int, steps: int, max_bs: int, seed: int) -> Scheduler:
    """Rank ``rank``'s requests; the last rank may run more than the largest graph."""
    last = rank == dp - 1
    return Scheduler(runtime, seed=seed + rank, num_requests=steps, max_running=max_bs + (OVERFLOW if last else 0),
                     max_new_tokens=(1, 4 * max_bs), max_arrival_gap=LAST_RANK_ARRIVAL_GAP if last else ARRIVAL_GAP)


def _rank_main(rank: int, dp: int, steps: int, backend: str, mode: str, max_bs: int, seed: int,
               progress: bool) -> Dict[str, Any]:
    """One rank: capture, then ``steps`` scheduler steps, one DP decode each (idle included)."""
    from ..reference.dp_model import DPAttention, ReferenceDPDecodeAdapter
    from ..runners.dp import DPDecodeRunner
    from ..runners.dp_exchange import DPExchange

    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "cuda" else torch.device("cpu")
    runtime = build_reference_model(TinyConfig(), device=device, seed=seed, max_num_reqs=max_bs + OVERFLOW)
    adapter = ReferenceDPDecodeAdapter(runtime, DPAttention())
    dp_runner = DPDecodeRunner(adapter, DPExchange(device=device), max_bs=max_bs, backend=backend, impl=mode,
                               progress=progress and rank == 0)
    runner = dp_runner.runner
    sched = _scheduler(runtime, rank, dp, steps, max_bs, seed)
    decodes: List[Dict[str, Any]] = []
    extends: Dict[int, torch.Tensor] = {}

    def extend_fn(fb):
        logits = runtime.forward(fb)
        extends[sched.step_idx] = logits.cpu().clone()
        return logits

    def decode_fn(fb):
        out, seconds = timed(device, lambda: dp_runner(fb))
        decodes.append({"step": sched.step_idx, "bs": fb.batch_size, "padded_bs": dp_runner.last.padded_bs,
                        "seconds": seconds, "logits": out.cpu().clone()})
        return out

    bar = progress_bar(range(steps), show=progress and rank == 0, desc="Decoding (rank 0)", unit="step",
                       leave=False)
    idle: List[Dict[str, Any]] = []
    for step in bar:
        count = len(decodes)
        if not sched.done:
            sched.step(decode_fn, extend_fn)
        if len(decodes) == count:  # nothing to decode here: still join the step's exchange
            dp_runner(None)
            idle.append({"step": step, "padded_bs": dp_runner.last.padded_bs})
    bar.close()
    return {"decodes": decodes, "extends": extends, "idle": idle, "captured_sizes": runner.captured_sizes,
            "capture_seconds": runner.capture_seconds, "registry_mode": runner.registry.impl,
            "backend": runner.backend.name, "graph_steps": dp_runner.graph_steps,
            "eager_steps": dp_runner.eager_steps, "skipped_steps": dp_runner.skipped_steps}


def _check_single_process(ranks: List[Dict[str, Any]], steps: int, max_bs: int, seed: int,
                          check: Any) -> List[List[int]]:
    """Replay every rank's requests through the plain model in this process; the
    ``[step, rank]`` of every forward whose logits differ."""
    dp = len(ranks)
    runtime = build_reference_model(TinyConfig(), seed=seed, max_num_reqs=dp * (max_bs + OVERFLOW))
    scheds = [_scheduler(runtime, r, dp, steps, max_bs, seed) for r in range(dp)]
    decodes = [{d["step"]: d["logits"] for d in rank["decodes"]} for rank in ranks]
    mismatches: List[List[int]] = []

    def checked(rank: int, theirs: Dict[int, torch.Tensor], fb: Any) -> torch.Tensor:
        step = scheds[rank].step_idx
        ours = runtime.forward(fb)
        if step not in theirs or not check(theirs[step], ours):
            mismatches.append([step, rank])
            return ours
        return theirs[step]  # sample the rank's tokens: both runs keep the same inputs

    for _ in range(steps):
        for r, sched in enumerate(scheds):
            if not sched.done:
                sched.step(lambda fb, r=r: checked(r, decodes[r], fb),
                           lambda fb, r=r: checked(r, ranks[r]["extends"], fb))
    return mismatches


def run_dp_demo(dp: int = 2, steps: int = 300, backend: str = "auto", mode: str = "generated", max_bs: int = 16,
                seed: int = 0, progress: bool = True, timeout: Optional[float] = None) -> Dict[str, Any]:
    """Spawn ``dp`` ranks, decode, check every rank's every step; the figures."""
    started = time.perf_counter()
    device = dp_device(backend, dp)
    graph_backend = "cuda" if device.type == "cuda" else "cpu"
    ranks = launch(_rank_main, dp, steps, graph_backend, mode, max_bs, seed, progress,
                   timeout=timeout or DEFAULT_TIMEOUT,
                   backend="nccl" if device.type == "cuda" else "gloo")
    with single_thread():
        check = output_check(device)
        mismatches = _check_single_process(ranks, steps, max_bs, seed, check)
    return _figures(ranks, device, check.name, mismatches, steps, max_bs, started)


def _figures(ranks: List[Dict[str, Any]], device: torch.device, check: str, mismatches: List[List[int]],
             steps: int, max_bs: int, started: float) -> Dict[str, Any]:
    # What each rank decided, step by step: the same on every rank, or the demo fails.
    decided = [{d["step"]: d["padded_bs"] for d in r["decodes"]} | {i["step"]: i["padded_bs"] for i in r["idle"]}
               for r in ranks]
    disagreeing = [s for s in range(steps) if len({d.get(s) for d in decided}) > 1]
    sizes = [{d["step"]: d["bs"] for d in r["decodes"]} for r in ranks]
    differ = sum(1 for s in range(steps) if len({sz.get(s, 0) for sz in sizes}) > 1)
    graph_s = [d["seconds"] for r in ranks for d in r["decodes"] if d["padded_bs"] is not None]
    eager_s = [d["seconds"] for r in ranks for d in r["decodes"] if d["padded_bs"] is None]
    first = ranks[0]
    return {
        "mode": "dp-decode", "dp": len(ranks), "backend": first["backend"],
        "dist_backend": "nccl" if device.type == "cuda" else "gloo", "device": str(device),
        "registry_mode": first["registry_mode"], "check": check, "torch": torch.__version__, "max_bs": max_bs,
        "captured_sizes": list(first["captured_sizes"]),
        "capture_seconds": max(r["capture_seconds"] for r in ranks), "steps": steps,
        "rank_batch_sizes": [sorted(set(sz.values())) for sz in sizes],
        "steps_with_different_sizes": differ,
        "graph_steps": first["graph_steps"], "eager_steps": first["eager_steps"],
        "skipped_steps": first["skipped_steps"], "idle_rank_steps": sum(len(r["idle"]) for r in ranks),
        "disagreeing_steps": disagreeing[:20],
        "checked_forwards": sum(len(r["decodes"]) + len(r["extends"]) for r in ranks),
        "mismatching_forwards": len(mismatches), "mismatch_ids": mismatches[:20],
        "graph_step_ms": 1e3 * statistics.fmean(graph_s) if graph_s else 0.0,
        "eager_step_ms": 1e3 * statistics.fmean(eager_s) if eager_s else 0.0,
        "seconds": time.perf_counter() - started,
    }


def dp_demo_failed(result: Dict[str, Any]) -> bool:
    return bool(result["mismatching_forwards"] or result["disagreeing_steps"])


def format_dp_table(result: Dict[str, Any]) -> str:
    backend = result["backend"] + (" (tape)" if result["backend"] == "cpu" else "")
    per_rank = "; ".join(f"rank {r}: {s[0]}-{s[-1]}" if s else f"rank {r}: none"
                         for r, s in enumerate(result["rank_batch_sizes"]))
    rows = [
        ("ranks", f"{result['dp']} ({result['dist_backend']}), backend {backend}, "
                  f"registry {result['registry_mode']}"),
        ("captured sizes", ", ".join(map(str, result["captured_sizes"]))),
        ("capture time", f"{result['capture_seconds']:.2f} s (slowest rank)"),
        ("steps", f"{result['steps']} ({result['steps_with_different_sizes']} with different sizes per rank)"),
        ("batch sizes", per_rank),
        ("agreed graph steps", str(result["graph_steps"])),
        ("agreed eager steps", f"{result['eager_steps']} (a rank beyond the largest graph)"),
        ("idle rank-steps", f"{result['idle_rank_steps']} ({result['skipped_steps']} steps with no work anywhere)"),
        ("disagreeing steps", str(len(result["disagreeing_steps"]))),
        ("mismatching forwards", f"{result['mismatching_forwards']} of {result['checked_forwards']} "
                                 f"({result['check']} vs one process, no DP)"),
        ("graph step", f"{result['graph_step_ms']:.3f} ms (check + exchange + fill + replay)"),
        ("eager step", f"{result['eager_step_ms']:.3f} ms (check + exchange + eager)"),
    ]
    return metric_table(rows)
