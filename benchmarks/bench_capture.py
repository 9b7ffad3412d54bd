"""Piecewise capture before and after compile-once (issue 43): Dynamo traces, capture time
and the tensors each key keeps, for a prefill runner over N token buckets on the CPU tape.

*Before* is ``graphslot/runners/piecewise.py`` as it was at ``BEFORE``, loaded from ``git
show`` into a module of its own (as ``bench_runner_step.py`` loads an old runner): a
Dynamo trace per bucket (``dynamic=False``), the pieces run as plain FX modules, one
warm-up per piece, every intermediate kept. Its split op is the attention as it was then,
returning a fresh tensor (copied at every replay), registered here as
``graphslot_bench::attention``. It runs inside today's runner, so inside today's capture
session, which on the tape changes nothing (the tape never collected per graph).

*After* is today's piecewise capture: one trace with the token dimension symbolic, each
piece compiled once by ``aot_eager``, one warm-up per key, intermediates held weakly and
the attention writing into a buffer the graph owns.

Per runner: ``traces`` (Dynamo graphs compiled), ``capture_s`` (the runner's capture
time: traces and compiles included), ``held_per_key`` (tensors a key's graph keeps alive
besides the static ones: ``SegmentedGraph.owned_tensors``), and a check that both give
the eager logits.

``python benchmarks/bench_capture.py [--sizes N] [--json]`` (default 35: the default
token ladder up to 832 tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from graphslot.graphs import graph_pool
from graphslot.reference import build_reference_model, make_extend_batch
from graphslot.reference.forward_batch import ForwardBatch
from graphslot.reference.graph_attention import GraphAttentionBackend
from graphslot.reference.model import Attention
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import PrefillGraphRunner
from graphslot.runners.contract import statics
from graphslot.runners.handles import op_handle, op_object
from graphslot.runners.prefill import token_buckets

ROOT = Path(__file__).resolve().parent.parent
#: The commit before compile-once.
BEFORE = "3296ac8"
BEFORE_OP = "graphslot_bench::attention"


def piecewise_before() -> types.ModuleType:
    """``graphslot.runners.piecewise`` as of :data:`BEFORE`, imported from that commit's text."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:graphslot/runners/piecewise.py"],
                           capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"bench_capture: cannot read piecewise.py as of {BEFORE} (a clone with that commit's "
                         f"history is needed): {shown.stderr.strip()}")
    name = "graphslot.runners._piecewise_before"
    module = types.ModuleType(name)
    module.__package__ = "graphslot.runners"
    sys.modules[name] = module
    exec(compile(shown.stdout, f"{BEFORE}:graphslot/runners/piecewise.py", "exec"), module.__dict__)
    return module


@torch.library.custom_op(BEFORE_OP, mutates_args=("k_cache", "v_cache"))
def attention_before(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out_cache_loc: torch.Tensor, layer_id: int, handle: int) -> torch.Tensor:
    fb = ForwardBatch.__new__(ForwardBatch)
    fb.out_cache_loc = out_cache_loc
    fb.out_cache_loc_swa = None
    return op_object(handle).forward(q, k, v, layer_id, fb)


@attention_before.register_fake
def _attention_before_fake(q, k, v, k_cache, v_cache, out_cache_loc, layer_id, handle):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class AttentionBefore(GraphAttentionBackend):
    """The reference attention's split op as it was at :data:`BEFORE`: a fresh result."""

    def forward(self, q, k, v, layer, fb):
        if not torch.compiler.is_compiling():
            return super().forward(q, k, v, layer, fb)
        layer_id = int(getattr(layer, "layer_id", layer))
        kv = self.inner.kv_cache
        return torch.ops.graphslot_bench.attention(q, k, v, kv.k_buffer[layer_id], kv.v_buffer[layer_id],
                                                   fb.out_cache_loc, layer_id, op_handle(self.inner))


class BeforeCapture:
    """The piecewise capture mode over the module of :data:`BEFORE`."""

    name = "piecewise"

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.split_ops = (BEFORE_OP,)

    def compile(self, fn):
        return self.module.compile_piecewise(fn, self.split_ops)

    def mark_rows(self, view, registry):
        pass  # dynamic=False: nothing is symbolic

    def capture(self, backend, run, *, warmup, context=None, stream=None):
        return self.module.capture_piecewise(backend, run, self.split_ops, warmup=warmup, context=context)


def runner_class(before: Optional[types.ModuleType]) -> type:
    if before is None:
        return PrefillGraphRunner

    class Before(PrefillGraphRunner):
        def _init_graphs(self, config, adapter_split_ops):
            super()._init_graphs(config, adapter_split_ops)
            self.capture_mode = BeforeCapture(before)

    return Before


def measure(buckets, before: Optional[types.ModuleType]) -> Dict[str, Any]:
    torch._dynamo.reset()
    rt = build_reference_model(max_num_reqs=64)
    adapter = ReferencePrefillAdapter(rt)
    if before is not None:
        for m in rt.model.modules():
            if isinstance(m, Attention):
                m.backend = AttentionBefore(m.backend.inner)
    start = time.perf_counter()
    runner = runner_class(before)(adapter, capture="piecewise", token_buckets=buckets, max_bs=8, progress=False,
                                  backend="cpu", graph_pool=graph_pool("cpu"))
    built = time.perf_counter() - start
    declared = [s.buffer for s in runner.registry.active] + statics(adapter)
    held = [len(g.owned_tensors(declared)) for g in runner.graphs.values()]
    fb = make_extend_batch(rt, rt.req_to_token_pool.alloc(3), [0] * 3, [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    same = torch.equal(runner(fb).clone(), rt.forward(fb))
    return {"traces": len(runner.captured_fn.compiled_modules), "capture_s": runner.capture_seconds,
            "build_s": built, "held_per_key": sum(held) / len(held), "held_total": sum(held),
            "pool_bytes": runner.backend.pool.nbytes, "equals_eager": same}


def run(sizes: int = 35) -> Dict[str, Any]:
    torch.set_num_threads(1)
    ladder = token_buckets(4096)
    buckets = sorted(ladder, reverse=False)[:sizes]
    result = {"before": BEFORE, "buckets": len(buckets), "largest": max(buckets), "torch": torch.__version__,
              "runners": {}}
    result["runners"]["before"] = measure(buckets, piecewise_before())
    result["runners"]["after"] = measure(buckets, None)
    return result


def table(result: Dict[str, Any]) -> str:
    lines = [f"piecewise prefill capture on the tape, {result['buckets']} token buckets up to {result['largest']} "
             f"(torch {result['torch']}, before = {result['before']})",
             f"{'runner':<8}{'traces':>8}{'capture s':>11}{'held/key':>10}{'pool MiB':>10}{'== eager':>10}"]
    lines += [f"{name:<8}{row['traces']:>8}{row['capture_s']:>11.2f}{row['held_per_key']:>10.1f}"
              f"{row['pool_bytes'] / 2**20:>10.1f}{str(row['equals_eager']):>10}"
              for name, row in result["runners"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the figures as JSON, not a table")
    parser.add_argument("--sizes", type=int, default=35, help="token buckets, smallest first (default 35)")
    args = parser.parse_args()
    result = run(args.sizes)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
