"""``graphslot demo --mode prefill``: the prefill graph runners against eager.

Multi-request prefill (EXTEND) batches of mixed prompt lengths, some of them chunked
continuations of requests cached by an earlier batch, run through each prefill graph
runner (captured per token bucket, batch size not padded) and through the eager
forward of an identical twin runtime (same seed, same weights, and, the allocators
being deterministic, the same request and KV slots). Every batch's logits are
compared. Nothing is shared between the two sides, so a wrong graph cannot leak into
the reference, and the K/V a continuation reads was written by the graph alone.

Each runner (the prefill runner with capture "breakable", then "piecewise") gets its own
pair of runtimes and the same seeded stream of batches.
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .common import human_bytes
from .limits import PREFILL_CACHED, PREFILL_REQUEST_SLOTS
from .demo_common import demo_device, fill_timings, representative, run_figures, single_thread, timed
from ..log import progress_bar
from ..reference import TinyConfig, build_reference_model, make_extend_batch
from ..reference.numerics import output_check

DEFAULT_BUCKETS = (64, 48, 32, 16, 8)
#: Request slots of the demo runtime; a batch plus the cached requests must fit.
MAX_NUM_REQS = PREFILL_REQUEST_SLOTS
MAX_LIVE = PREFILL_CACHED
MAX_DEMO_BS = MAX_NUM_REQS - MAX_LIVE
RunnerFactory = Callable[[Any, Dict[str, Any]], Any]


# ------------------------------------------------------------------------- runners


def _make_runner(capture: str, runtime: Any, options: Dict[str, Any]) -> Any:
    from ..reference.prefill_adapter import ReferencePrefillAdapter
    from ..runners.prefill import PrefillGraphRunner

    return PrefillGraphRunner(ReferencePrefillAdapter(runtime), capture=capture, **options)


#: Runner name (the prefill runner's capture mode) -> factory ``(runtime, options) -> runner``, in report order.
RUNNERS: Dict[str, RunnerFactory] = {name: functools.partial(_make_runner, name) for name in ("breakable", "piecewise")}


# ------------------------------------------------------------------------ workload


class _Request:
    __slots__ = ("rpi", "cached", "slots")

    def __init__(self, rpi: int) -> None:
        self.rpi = rpi
        self.cached = 0
        self.slots = []


def prefill_batches(runtime: Any, count: int, seed: int, max_bs: int, max_tokens: int,
                    max_live: int = 16) -> Iterator[Any]:
    """``count`` seeded EXTEND batches of 1..``max_bs`` requests and at most ``max_tokens``
    tokens. About a third of the requests continue one cached by an earlier batch
    (chunked prefill, prefix > 0); a request finishes (its request slot and KV slots
    freed) at random or at the context limit. The stream depends only on the seed and
    the pools' (deterministic) allocators, so identical runtimes get identical batches.

    Consume it lazily: finished requests are freed when the next batch is asked for.
    """
    rng = random.Random(seed)
    ctx = runtime.config.max_context_len
    vocab = runtime.config.vocab_size
    live: List[_Request] = []
    for _ in range(count):
        bs = rng.randint(1, max_bs)
        reqs: List[_Request] = []
        for _ in range(bs):
            if live and rng.random() < 0.35:
                reqs.append(live.pop(rng.randrange(len(live))))
            else:
                reqs.append(_Request(runtime.req_to_token_pool.alloc(1)[0]))
        share = max(1, max_tokens // bs)
        budget = max_tokens
        lens = []
        for i, r in enumerate(reqs):
            cap = min(ctx - r.cached, budget - (bs - 1 - i), rng.choice((share, 2 * share, 4)))
            n = rng.randint(1, max(1, cap))
            lens.append(n)
            budget -= n
        prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]
        fb = make_extend_batch(runtime, [r.rpi for r in reqs], [r.cached for r in reqs], prompts)
        yield fb
        start = 0
        for r, n in zip(reqs, lens):
            r.slots.extend(int(s) for s in fb.out_cache_loc[start:start + n].tolist())
            r.cached += n
            start += n
            if r.cached >= ctx or rng.random() < 0.5:
                _finish(runtime, r)
            else:
                live.append(r)
        while len(live) > max_live:
            _finish(runtime, live.pop(0))


def _finish(runtime: Any, r: _Request) -> None:
    runtime.token_to_kv_pool.free(r.slots)
    runtime.req_to_token_pool.free(r.rpi)


# -------------------------------------------------------------------------- figures


def _one_or_all(values: Sequence[int]) -> Any:
    distinct = sorted(set(values))
    return distinct[0] if len(distinct) == 1 else distinct


def _prefill_fill_timings(runner: Any, fb: Any) -> Dict[str, Any]:
    """``fill_from`` of ``fb``, token-padded as the runner pads it."""
    adapter = runner.adapter
    bs = adapter.batch_size(fb)
    raw = adapter.num_tokens(fb)
    n = runner.bucket(fb)
    side = adapter.side_inputs()
    return fill_timings("prefill", runner.registry,
                        lambda reg: reg.fill_from(fb, raw_bs=bs, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=n,
                                                  side_inputs=side),
                        f"{bs} reqs, {raw} -> {n} tokens")


# ------------------------------------------------------------------------------ run


def run_prefill_demo(
    batches: int = 50,
    backend: str = "auto",
    mode: str = "generated",
    max_bs: int = 8,
    token_buckets: Optional[Sequence[int]] = None,
    runners: Optional[Sequence[str]] = None,
    seed: int = 0,
    progress: bool = True,
) -> Dict[str, Any]:
    """Capture each prefill runner, run ``batches`` prefill batches graph-vs-eager, report.

    ``token_buckets`` defaults to :data:`DEFAULT_BUCKETS`; no batch exceeds the largest.
    ``runners`` names the runners to run (default: all of :data:`RUNNERS`).
    """
    token_buckets = tuple(DEFAULT_BUCKETS if token_buckets is None else token_buckets)
    if not token_buckets:
        raise ValueError("no token buckets")
    if not 1 <= max_bs <= min(max(token_buckets), MAX_DEMO_BS):
        raise ValueError(f"max_bs must be 1..{min(max(token_buckets), MAX_DEMO_BS)} (at least one token per "
                         f"request in the largest bucket, {max(token_buckets)}), got {max_bs}")
    names = list(RUNNERS) if runners is None else list(dict.fromkeys(runners))
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown prefill runner {unknown[0]!r}; choose from: {', '.join(RUNNERS)}")
    with single_thread():
        return _run(names, batches, backend, mode, max_bs, token_buckets, seed, progress)


def _run(names: List[str], count: int, backend: str, mode: str, max_bs: int, buckets: Tuple[int, ...],
         seed: int, progress: bool) -> Dict[str, Any]:
    device = demo_device(backend)
    started = time.perf_counter()
    max_tokens = max(buckets)
    options = dict(max_bs=max_bs, token_buckets=buckets, backend=backend, impl=mode,
                   progress=None if progress else False)
    check = output_check(device)
    rows: List[Dict[str, Any]] = []
    shared: Dict[str, Any] = {}
    for name in names:
        runtime, twin = (build_reference_model(TinyConfig(), device=device, dtype=torch.float32, seed=seed,
                                               max_num_reqs=MAX_NUM_REQS) for _ in range(2))
        runner = RUNNERS[name](runtime, dict(options))
        graph_s: List[float] = []
        eager_s: List[float] = []
        mismatches: List[int] = []
        seen: List[Any] = []
        used: Dict[int, int] = {}
        stream = zip(prefill_batches(runtime, count, seed, max_bs, max_tokens, MAX_LIVE),
                     prefill_batches(twin, count, seed, max_bs, max_tokens, MAX_LIVE))
        bar = progress_bar(stream, show=progress, total=count, desc=f"Prefill ({name})", unit="batch",
                           leave=False)
        for i, (fb, twin_fb) in enumerate(bar):
            if not runner.can_run(fb):  # the stream stays within the buckets; a miss is a bug
                raise RuntimeError(f"batch {i} ({fb.batch_size} reqs, {fb.num_tokens} tokens) fits no bucket")
            if not (torch.equal(fb.input_ids, twin_fb.input_ids)
                    and torch.equal(fb.out_cache_loc, twin_fb.out_cache_loc)):
                raise RuntimeError(f"batch {i}: the twin runtime's batch differs (tokens or KV slots)")
            graph, seconds = timed(device, lambda: runner.replay(fb))
            graph_s.append(seconds)
            eager, seconds = timed(device, lambda: twin.forward(twin_fb))
            eager_s.append(seconds)
            if not check(graph, eager):
                mismatches.append(i)
            bucket = runner.bucket(fb)
            used[bucket] = used.get(bucket, 0) + 1
            seen.append(fb)
            bar.set_postfix(reqs=fb.batch_size, tokens=fb.num_tokens, mismatches=len(mismatches))
        if progress and bar.disable:  # no terminal for a bar: a line per runner
            print(f"graphslot demo: {name} runner: {len(seen)} batches, {len(mismatches)} mismatching",
                  file=sys.stderr)
        rows.append({
            "runner": name,
            "buckets": list(runner.buckets),
            "capture_seconds": runner.capture_seconds,
            "segments_per_graph": _one_or_all([g.num_segments for g in runner.graphs.values()]),
            "eager_steps_per_graph": _one_or_all([g.num_eager_steps for g in runner.graphs.values()]),
            "bucket_use": {str(b): used.get(b, 0) for b in runner.buckets},
            "mismatching_batches": len(mismatches),
            "mismatch_batch_ids": mismatches[:20],
            "eager_batch_ms": 1e3 * statistics.fmean(eager_s) if eager_s else 0.0,
            "graph_batch_ms": 1e3 * statistics.fmean(graph_s) if graph_s else 0.0,
            "static_bytes": runner.static_bytes,
        })
        if not shared:  # the batch stream and the prefill registry are the same for every runner
            reqs = [b.batch_size for b in seen]
            toks = [b.num_tokens for b in seen]
            shared = {
                **run_figures(runner, device, check.name, max_bs),
                "batches": len(seen),
                "requests_per_batch": [min(reqs), max(reqs)] if reqs else [],
                "request_counts": sorted(set(reqs)),
                "tokens_per_batch": [min(toks), max(toks)] if toks else [],
                "chunked_batches": sum(1 for b in seen if int(b.extend_prefix_lens.max()) > 0),
            }
            if seen:
                shared.update(_prefill_fill_timings(runner, representative(seen, runner.graphs,
                                                                           lambda b: b.num_tokens)))
    result: Dict[str, Any] = {"mode": "prefill", **shared, "runners": rows,
                              "mismatching_batches": sum(r["mismatching_batches"] for r in rows)}
    result["seconds"] = time.perf_counter() - started
    return result


def _span(pair: Sequence[int]) -> str:
    return f"{pair[0]}-{pair[1]}" if pair else "none"


def _per_graph(row: Dict[str, Any]) -> str:
    eager = row["eager_steps_per_graph"]
    return f"{row['segments_per_graph']} (+ {eager} eager steps between)"


def format_prefill_table(result: Dict[str, Any]) -> str:
    backend = result["backend"] + (" (tape)" if result["backend"] == "cpu" else "")
    rows: List[Tuple[str, str]] = [
        ("backend", f"{backend}, registry {result['registry_mode']}"),
        ("batches", f"{result['batches']} ({result['chunked_batches']} with chunked-prefill continuations)"),
        ("requests per batch", f"{_span(result['requests_per_batch'])} "
                               f"({len(result['request_counts'])} distinct counts)"),
        ("tokens per batch", _span(result["tokens_per_batch"])),
        ("mismatching batches", f"{result['mismatching_batches']} ({result['check']} vs eager, all runners)"),
    ]
    if "fill_us_generated" in result:
        batch = result["fill_batch"]
        rows += [("fill_from generated", f"{result['fill_us_generated']:.1f} µs ({batch})"),
                 ("fill_from interpreted", f"{result['fill_us_interpreted']:.1f} µs ({batch})")]
    for row in result["runners"]:
        rows += [
            ("runner", row["runner"]),
            ("  buckets captured", ", ".join(map(str, row["buckets"]))),
            ("  capture time", f"{row['capture_seconds']:.2f} s"),
            ("  segments per graph", _per_graph(row)),
            ("  mismatching batches", str(row["mismatching_batches"])),
            ("  eager batch", f"{row['eager_batch_ms']:.3f} ms"),
            ("  graph batch", f"{row['graph_batch_ms']:.3f} ms (fill + metadata + replay + logits)"),
            ("  static buffers", human_bytes(row["static_bytes"])),
        ]
    width = max(len(r[0]) for r in rows + [("metric", "")])
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 5}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
