"""gpu_proof part 1: the transformers batcher's greedy tokens against ``generate``, before
and after ``torch.compile(mode="reduce-overhead")`` ran in the same process.

    python3 benchmarks/proof_batcher.py --result PATH [--smoke]

A ``LlamaForCausalLM`` at Llama-3.2-1B's shape (bf16, fan-in scaled random weights;
smoke: tiny, fp32, CPU tape). 32 prompts (the first 8 of one length, the rest 16-128
tokens); the reference is ``generate``'s greedy tokens of each (no padding). Cases:

1. ``ContinuousBatcher(max_bs=32)`` serves batches of 1, 8 and 32 requests (16 new
   tokens each), then a trace whose requests arrive so the decode batch changes size
   every step;
2. ``torch.compile(model, mode="reduce-overhead")`` decodes batches of 1 and 8 with a
   ``StaticCache`` (CUDAGraph Trees records graphs and clears cuBLAS's workspaces);
3. the same batcher again (its graphs captured before 2), batch 8 and the trace.

Every request's tokens must equal the reference; a mismatch names its first differing
token and the reference's top-1/top-2 logit margin there (a bf16 near-tie, or a bug).
The last GPU run of this sequence ended in an illegal memory access in step 3 (graphs
captured with the workspace CUDAGraph Trees freed); the batcher now captures with a
workspace of its own (``CudaGraphBackend(fresh_cublas_workspace=True)``).
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any, Dict, List


from proof_common import (Recorder, build_llama, compare, describe, piece_args, prompts_of, reduce_overhead, reference,
                          ro_generate, sync, target_device)


class Shape:
    def __init__(self, smoke: bool):
        self.max_bs = 4 if smoke else 32
        self.batches = (1, 2, 4) if smoke else (1, 8, 32)
        self.compiled_batches = (1, 2) if smoke else (1, 8)
        self.new_tokens = 6 if smoke else 16
        self.context = 64 if smoke else 256
        self.trace_steps = 8 if smoke else 40
        same = 8 if smoke else 64
        varied = list(range(4, 24, 3)) if smoke else list(range(16, 129, 7))
        self.lengths = [same] * self.compiled_batches[-1] + varied


def serve(engine, prompts: List[List[int]], which: List[int], new_tokens: List[int]) -> Dict[str, Any]:
    """All requests at once, run to the end: their tokens and the decode sizes."""
    handles: Dict[int, Any] = {}
    reqs: Dict[int, int] = {}
    for p, n in zip(which, new_tokens):
        req = engine.add_request(prompts[p], n)
        handles[req.rid] = req
        reqs[req.rid] = p
    sizes = []
    start = time.perf_counter()
    while not engine.done:
        sizes.append(engine.step().decode_batch_size)
    return {"tokens": {r: h.output for r, h in handles.items()}, "which": reqs, "sizes": sizes,
            "seconds": time.perf_counter() - start}


def changing_trace(engine, prompts: List[List[int]], shape: Shape, seed: int) -> Dict[str, Any]:
    """Requests arrive (2..new_tokens tokens each) so that each step's decode batch differs
    in size from the last one's; then the batcher drains."""
    rng = random.Random(seed)
    handles: Dict[int, Any] = {}
    which: Dict[int, int] = {}
    sizes: List[int] = []
    last = 0
    step = 0
    start = time.perf_counter()
    while step < shape.trace_steps or not engine.done:
        if step < shape.trace_steps:
            running = len(engine.running)
            room = shape.max_bs - running - len(engine.waiting)
            # Never full unless forced: a full batch that nobody leaves cannot change size.
            changes = [k for k in range(min(room, 4) + 1) if running + k != last]
            arrivals = [k for k in changes if running + k < shape.max_bs] or changes or [0]
            for _ in range(rng.choice(arrivals)):
                p = rng.randrange(len(prompts))
                req = engine.add_request(prompts[p], rng.randint(2, shape.new_tokens))
                handles[req.rid] = req
                which[req.rid] = p
        last = engine.step().decode_batch_size
        sizes.append(last)
        step += 1
    changed = sum(a != b for a, b in zip(sizes, sizes[1:shape.trace_steps]))
    return {"tokens": {r: h.output for r, h in handles.items()}, "which": which, "sizes": sizes,
            "steps_changing_size": changed, "steps": min(shape.trace_steps, len(sizes)) - 1,
            "seconds": time.perf_counter() - start}


def checked(result: Dict[str, Any], ref: Dict[str, Any]) -> Dict[str, Any]:
    out = compare(result["tokens"], ref, result["which"])
    out.update({k: v for k, v in result.items() if k not in ("tokens", "which")})
    out["distinct_sizes"] = sorted(set(result["sizes"]))
    return out


def main(argv=None) -> int:
    args = piece_args(__doc__.splitlines()[0], argv)
    from graphslot.integrations.transformers import ContinuousBatcher

    shape = Shape(args.smoke)
    device = target_device(args.smoke)
    rec = Recorder(args.result, **describe(device), smoke=args.smoke, max_bs=shape.max_bs)
    start = time.perf_counter()
    model = build_llama(args.smoke, device)
    prompts = prompts_of(shape.max_bs, shape.lengths, model.config.vocab_size)
    rec["model_s"] = time.perf_counter() - start
    ref = reference(model, prompts, shape.new_tokens)
    rec["reference_s"] = time.perf_counter() - start - rec["model_s"]
    print("proof_batcher: reference done", file=sys.stderr, flush=True)
    # mix_prefill off, as on a GPU: a request decodes in the step that admits it.
    engine = ContinuousBatcher(model, max_bs=shape.max_bs, max_context_len=shape.context, eos_token_id=(),
                               backend="cpu" if args.smoke else "auto", mix_prefill=False,
                               kv_cache_bytes=None if args.smoke else 2 << 30)
    rec["capture"] = {"seconds": engine.runner.capture_seconds, "graphs": len(engine.runner.graphs)}
    rec["batches"] = {}
    for bs in shape.batches:
        got = rec.attempt(f"batch {bs}", lambda: serve(engine, prompts, list(range(bs)), [shape.new_tokens] * bs))
        if got:
            rec["batches"][str(bs)] = checked(got, ref)
            rec.save()
    rec["trace"] = rec.attempt("trace", lambda: checked(changing_trace(engine, prompts, shape, 1), ref))
    print("proof_batcher: batcher checked; reduce-overhead next", file=sys.stderr, flush=True)
    compiled = reduce_overhead(model, args.smoke)
    rec["reduce_overhead"] = {}
    for bs in shape.compiled_batches:
        def run(bs=bs):
            t0 = time.perf_counter()
            tokens = ro_generate(compiled, model, prompts[:bs], shape.new_tokens, shape.context, not args.smoke)
            sync(device)
            out = compare(dict(enumerate(tokens)), ref, {i: i for i in range(bs)})
            return {**out, "seconds": time.perf_counter() - t0}

        rec["reduce_overhead"][str(bs)] = rec.attempt(f"reduce-overhead batch {bs}", run)
        rec.save()
    print("proof_batcher: reduce-overhead ran; the batcher again", file=sys.stderr, flush=True)
    bs = shape.compiled_batches[-1]
    again = rec.attempt("batcher after reduce-overhead",
                        lambda: checked(serve(engine, prompts, list(range(bs)), [shape.new_tokens] * bs), ref))
    rec["after_reduce_overhead"] = {"batch": again, "trace": rec.attempt(
        "trace after reduce-overhead", lambda: checked(changing_trace(engine, prompts, shape, 2), ref))}
    sync(device)
    rec["metrics"] = {k: v for k, v in engine.runner.metrics().items() if k in ("eager_fallbacks", "eager_reasons")}
    rec["seconds"] = time.perf_counter() - start
    return 0


if __name__ == "__main__":
    sys.exit(main())
