"""``graphslot demo --model hf-llama`` (and each tested family): a transformers model
through the decode graph runner, checked against plain transformers per request.

A tiny random-weight model of the family is built from its transformers config class
(nothing is downloaded). Requests arrive at random steps and finish at random lengths,
so the decode batch size changes from step to step; :class:`ContinuousBatcher`
prefills arrivals eagerly through transformers into the paged cache and decodes the
running batch through graphs captured for a handful of sizes. Every prefill and decode
row is compared (allclose) with the same request decoded alone by transformers with a
``DynamicCache``, fed the same tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Dict, List, Tuple

import torch

from ..log import progress_bar
from .common import human_bytes, metric_table
from .demo_common import demo_device, run_figures, single_thread, timed

MAX_CONTEXT_LEN = 64


def hf_demo_models() -> Tuple[str, ...]:
    """``hf-<family>`` for each tiny-model recipe in
    :data:`graphslot.integrations.transformers.models.FAMILIES`, imported on this call
    (ImportError, one line naming the ``hf`` extra, without transformers)."""
    from ..integrations.transformers.models import FAMILIES

    return tuple(f"hf-{family}" for family in FAMILIES)


def run_hf_demo(
    model: str = "hf-llama",
    steps: int = 200,
    backend: str = "auto",
    mode: str = "generated",
    max_bs: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> Dict[str, Any]:
    """Decode ``steps`` continuous-batching steps of a tiny ``model`` graph vs transformers.

    Raises ``ValueError`` for a name not in :func:`hf_demo_models` and ``ImportError``
    (one line, naming the ``hf`` extra) without transformers. The result is plain JSON.
    """
    models = hf_demo_models()  # ImportError names the extra
    if model not in models:
        raise ValueError(f"unknown demo model {model!r}; choose one of: {', '.join(models)}")
    from ..integrations import transformers as hf

    with single_thread():
        return _run(hf, model, steps, backend, mode, max_bs, seed, progress)


def _run(hf, name: str, steps: int, backend: str, mode: str, max_bs: int, seed: int,
         progress: bool) -> Dict[str, Any]:
    import transformers

    started = time.perf_counter()
    family = name.removeprefix("hf-")
    device = demo_device(backend)
    model = hf.tiny_model(family, seed=seed, device=device)
    # mix_prefill off: the demo shows every decode step replayed from a graph
    engine = hf.ContinuousBatcher(model, max_bs=max_bs, max_context_len=MAX_CONTEXT_LEN, backend=backend,
                                  impl=mode, progress=None if progress else False, mix_prefill=False)
    reference = hf.PerRequestHF(model)
    rng = random.Random(seed)
    decode_s: List[float] = []
    reference_s: List[float] = []
    sizes: List[int] = []
    mismatches: List[int] = []
    worst = 0.0
    rows = 0
    graph_steps = 0
    finished = 0
    admitted = 0

    bar = progress_bar(range(steps), show=progress, desc=f"Decoding {name}", unit="step", leave=False)
    for step in bar:
        # Arrivals: a burst now and then, more when the batch runs low.
        if rng.random() < (0.6 if len(engine.running) < max_bs // 2 else 0.2):
            for _ in range(rng.randint(1, 3)):
                prompt = [rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(1, 16))]
                engine.add_request(prompt, max_new_tokens=rng.randint(1, MAX_CONTEXT_LEN - len(prompt)) // 2 + 1)
        out = engine.step()
        admitted += len(out.prefill_logits)
        ok = True

        def check(got: torch.Tensor, want: torch.Tensor) -> bool:
            nonlocal worst, rows
            rows += 1
            worst = max(worst, hf.models.max_abs_diff(got, want))
            return hf.models.close(got, want)

        def reference_rows() -> list:
            pairs = [(out.prefill_logits[rid], reference.prefill(rid, engine.requests[rid].prompt))
                     for rid in out.prefill_logits]
            return pairs + [(logits, reference.decode(rid, token)) for rid, (token, logits) in out.decode.items()]

        pairs, seconds = timed(device, reference_rows)
        for got, want in pairs:
            ok = check(got, want) and ok
        for rid in out.finished:
            reference.drop(rid)
        finished += len(out.finished)
        if out.decode_batch_size:
            sizes.append(out.decode_batch_size)
            decode_s.append(out.decode_seconds)
            reference_s.append(seconds)
            graph_steps += out.decode_graph
        if not ok:
            mismatches.append(step)
        bar.set_postfix(bs=out.decode_batch_size, mismatches=len(mismatches))
    bar.close()

    runner = engine.runner
    pool = engine.cache.pool
    kv_bytes = sum(t.numel() * t.element_size() for t in pool.k_buffer + pool.v_buffer)
    return {
        "mode": "hf-decode",
        "model": name,
        "model_class": type(model).__name__,
        "config": {**{k: getattr(model.config, k, None) for k in ("hidden_size", "num_hidden_layers",
                                                                   "num_attention_heads", "vocab_size")},
                   "num_key_value_heads": engine.geometry[0].k_heads},  # what a layer caches (the probe)
        "layer_kinds": [kind for kind, _ in engine.cache.layer_kinds],
        "transformers": transformers.__version__,
        **run_figures(runner, device, f"allclose(atol={hf.models.ATOL}, rtol={hf.models.RTOL}) vs transformers "
                                      "per request", max_bs),
        "captured_sizes": list(runner.captured_sizes),
        "capture_seconds": runner.capture_seconds,
        "steps": steps,
        "decode_steps": len(sizes),
        "graph_steps": graph_steps,
        "batch_sizes": sorted(set(sizes)),
        "batch_size_changes": sum(a != b for a, b in zip(sizes, sizes[1:])),
        "requests_admitted": admitted,
        "requests_finished": finished,
        "rows_checked": rows,
        "mismatching_steps": len(mismatches),
        "mismatch_step_ids": mismatches[:20],
        "max_abs_diff": worst,
        "graph_step_ms": 1e3 * statistics.fmean(decode_s) if decode_s else 0.0,
        "transformers_step_ms": 1e3 * statistics.fmean(reference_s) if reference_s else 0.0,
        "static_bytes": runner.static_bytes,
        "kv_pool_bytes": kv_bytes,
        "seconds": time.perf_counter() - started,
    }


def format_hf_demo_table(result: Dict[str, Any]) -> str:
    backend = result["backend"] + (" (tape)" if result["backend"] == "cpu" else "")
    sizes = result["batch_sizes"]
    span = f"{sizes[0]}-{sizes[-1]}, {len(sizes)} distinct" if sizes else "none"
    cfg = result["config"]
    kinds = sorted(set(result["layer_kinds"]))
    rows = [
        ("model", f"{result['model']}: {result['model_class']} (transformers {result['transformers']}), "
                  f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} "
                  f"heads / {cfg['num_key_value_heads']} kv, {'+'.join(kinds)}"),
        ("backend", f"{backend}, registry {result['registry_mode']}"),
        ("captured sizes", ", ".join(map(str, result["captured_sizes"]))),
        ("capture time", f"{result['capture_seconds']:.2f} s"),
        ("steps", f"{result['steps']} ({result['decode_steps']} decode, {result['graph_steps']} replayed; "
                  f"batch sizes {span}, changed {result['batch_size_changes']} times)"),
        ("requests", f"{result['requests_admitted']} joined, {result['requests_finished']} finished"),
        ("mismatching steps", f"{result['mismatching_steps']} ({result['check']}; {result['rows_checked']} rows)"),
        ("max |diff|", f"{result['max_abs_diff']:.2g}"),
        ("graph decode step", f"{result['graph_step_ms']:.3f} ms (batch + fill + replay + sampling)"),
        ("transformers per request", f"{result['transformers_step_ms']:.3f} ms per step (the check)"),
        ("static buffers", human_bytes(result["static_bytes"])),
        ("kv pool", human_bytes(result["kv_pool_bytes"])),
    ]
    return metric_table(rows)
