"""``graphslot demo`` (the decode workload): the decode graph runner against eager, on the reference model.

Continuous batching (requests arrive and finish, so the batch size changes every few
steps) decodes through graphs captured for a handful of sizes; every step's logits are
checked against the eager forward of the same step. Both run inside one ``decode_fn``:
they write identical K/V into the same slots, so each sees the cache the other left.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List

import torch

from ..log import progress_bar
from ..reference import Scheduler, TinyConfig, build_reference_model
from ..reference.adapter import ReferenceDecodeAdapter
from ..reference.numerics import output_check
from ..runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from .common import human_bytes, metric_table
from .demo_common import demo_device, fill_timings, representative, run_figures, single_thread, timed


def run_demo(
    steps: int = 300,
    backend: str = "auto",
    mode: str = "generated",
    max_bs: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> Dict[str, Any]:
    """Capture, decode ``steps`` scheduler steps graph-vs-eager, and report figures."""
    with single_thread():
        return _run(steps, backend, mode, max_bs, seed, progress)


def _run(steps: int, backend: str, mode: str, max_bs: int, seed: int, progress: bool) -> Dict[str, Any]:
    device = demo_device(backend)
    started = time.perf_counter()
    config = TinyConfig()
    runtime = build_reference_model(config, device=device, dtype=torch.float32, seed=seed,
                                     max_num_reqs=max(max_bs, 8))
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(runtime), DecodeRunnerConfig(
        max_bs=max_bs, backend=backend, impl=mode, progress=None if progress else False))
    check = output_check(device)

    # Long generations and frequent arrivals keep the running set between 1 and max_bs.
    sched = Scheduler(runtime, seed=seed, num_requests=steps, max_running=max_bs,
                      max_new_tokens=(1, 4 * max_bs), max_arrival_gap=2)
    graph_s: List[float] = []
    eager_s: List[float] = []
    mismatches: List[int] = []
    batches: List[Any] = []

    def decode_fn(fb):
        graph, seconds = timed(device, lambda: runner.replay(fb))
        graph_s.append(seconds)
        eager, seconds = timed(device, lambda: runtime.forward(fb))
        eager_s.append(seconds)
        if not check(graph, eager):
            mismatches.append(sched.step_idx)
        batches.append(fb)
        return eager

    bar = progress_bar(range(steps), show=progress, desc="Decoding", unit="step", leave=False)
    for _ in bar:
        if sched.done:
            break
        sched.step(decode_fn)
        bar.set_postfix(bs=len(sched.running), mismatches=len(mismatches))
    bar.close()

    sizes = sorted({b.batch_size for b in batches})
    result: Dict[str, Any] = {
        "mode": "decode",
        **run_figures(runner, device, check.name, max_bs),
        "captured_sizes": list(runner.captured_sizes),
        "capture_seconds": runner.capture_seconds,
        "steps": sched.step_idx,
        "decode_steps": len(batches),
        "batch_sizes": sizes,
        "mismatching_steps": len(mismatches),
        "mismatch_step_ids": mismatches[:20],
        "eager_step_ms": 1e3 * statistics.fmean(eager_s) if eager_s else 0.0,
        "graph_step_ms": 1e3 * statistics.fmean(graph_s) if graph_s else 0.0,
        "static_bytes": runner.static_bytes,
        "runner_metrics": runner.metrics(),
    }
    if batches:
        fb = representative(batches, runner.graphs, lambda b: b.batch_size)
        raw = fb.batch_size
        padded = runner.padded_bs(fb)
        result.update(fill_timings("decode", runner.registry,
                                   lambda reg: reg.fill_from(fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw,
                                                             padded_num_tokens=padded),
                                   f"{raw} -> {padded}"))
    result["seconds"] = time.perf_counter() - started
    return result


def format_demo_table(result: Dict[str, Any]) -> str:
    backend = result["backend"] + (" (tape)" if result["backend"] == "cpu" else "")
    sizes = result["batch_sizes"]
    span = f"{sizes[0]}-{sizes[-1]}, {len(sizes)} distinct" if sizes else "none"
    rows = [
        ("backend", f"{backend}, registry {result['registry_mode']}"),
        ("captured sizes", ", ".join(map(str, result["captured_sizes"]))),
        ("capture time", f"{result['capture_seconds']:.2f} s"),
        ("steps", f"{result['steps']} ({result['decode_steps']} decode; batch sizes {span})"),
        ("mismatching steps", f"{result['mismatching_steps']} ({result['check']} vs eager)"),
        ("eager step", f"{result['eager_step_ms']:.3f} ms"),
        ("graph step", f"{result['graph_step_ms']:.3f} ms (fill + metadata + replay)"),
    ]
    if "fill_us_generated" in result:
        batch = f"bs {result['fill_batch']}"
        rows += [("fill_from generated", f"{result['fill_us_generated']:.1f} µs ({batch})"),
                 ("fill_from interpreted", f"{result['fill_us_interpreted']:.1f} µs ({batch})")]
    rows.append(("static buffers", human_bytes(result["static_bytes"])))
    metrics = result["runner_metrics"]
    per_size = ", ".join(f"{bs}: {n}" for bs, n in metrics["replays_per_size"].items())
    rows += [("replays per size", per_size or "none"),
             ("padded rows", f"{metrics['padded_rows']} ({100 * metrics['padding_fraction']:.1f}% of rows computed)"),
             ("eager fallbacks", f"{metrics['eager_fallbacks']}" + "".join(
                 f"; {reason}: {n}" for reason, n in metrics["eager_reasons"].items()))]
    return metric_table(rows)
