"""gpu_proof part 4: serving at Llama-3.2-1B's shape, graphslot against what an HF user has.

    python3 benchmarks/proof_serving.py --result PATH [--smoke]

One ``LlamaForCausalLM`` (bf16, fan-in scaled random weights; smoke: tiny, fp32, CPU),
in this order (the figures are saved after each case, so a run cut short keeps them):

1. the changing-batch trace (the target): a seeded batch size in 1..32 every step, ms
   per step, first pass and steady, for graphslot's decode runner against
   ``torch.compile(mode="reduce-overhead")`` with a ``StaticCache`` per size and padded to
   32 (benchmarks/bench_hf_decode.py's ``changing_trace``; each step decodes the same
   token at the same position, so its tokens are not a generation and are not checked);
2. at batch 1, 8 and 32: ``bs`` requests of one 256-token prompt length, 32 new tokens
   each, greedy, through batched ``generate`` (the reference: no padding, so exact),
   graphslot's ``ContinuousBatcher``, the reduce-overhead model decoding with a
   ``StaticCache`` (the prompt eager) and transformers' continuous batching
   (``ContinuousBatchingManager``, bench_hf_serving.py's settings). Each engine runs once
   to warm up and once timed (wall, synchronized): tokens/s is new tokens over that
   time, ms per step that time over 32 (the prefill included, the same for all); every
   engine's tokens are checked against generate's.

Target: graphslot ahead of reduce-overhead on the changing trace.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Callable, Dict, List

from proof_common import Recorder, build_llama, compare, describe, piece_args, ro_generate, sync, target_device

#: graphslot's KV pools here (two engines share the GPU with the compiled model's graphs).
KV_BYTES = 8 << 30


def timed_run(device, run: Callable[[], List[List[int]]]) -> Dict[str, Any]:
    run()  # warm-up: compile, recording, lazy inits
    sync(device)
    start = time.perf_counter()
    tokens = run()
    sync(device)
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def keeping_attention(model, run: Callable[[], Any]) -> Any:
    """``run()``, the model's attention implementation as it was afterwards, even when
    ``run`` fails: transformers' continuous batching switches it to ``paged|...`` before
    its warm-up and (5.17, the GPU machine's) puts it back only when it got that far, so
    a failed hf_cb left every later engine on paged attention (wrong tokens, or a raise)."""
    attention = model.config._attn_implementation
    try:
        return run()
    finally:
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)


def engines(s, prompts: List[List[int]], new_tokens: int) -> Dict[str, Callable[[], List[List[int]]]]:
    import torch

    import bench_hf_serving
    from graphslot.integrations.transformers import ContinuousBatcher

    model = s.model
    bs = len(prompts)
    if getattr(s, "batcher", None) is None:  # one for every batch size: captured once
        s.batcher = ContinuousBatcher(model, max_bs=s.max_bs, max_context_len=s.context, eos_token_id=(),
                                      mix_prefill=False, backend="cpu" if s.smoke else "auto",
                                      kv_cache_bytes=None if s.smoke else KV_BYTES)
    batcher = s.batcher

    def generate():
        ids = torch.tensor(prompts, device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    def graphslot():
        reqs = [batcher.add_request(p, new_tokens) for p in prompts]
        while not batcher.done:
            batcher.step()
        return [r.output for r in reqs]

    def hf_cb():
        return keeping_attention(model, bench_hf_serving.hf_cb_engine(model, [(p, new_tokens) for p in prompts], bs))[0]

    compiled = s.compiled

    def reduce_overhead():
        return ro_generate(compiled.forward, model, prompts, new_tokens, s.context, not s.smoke)

    return {"generate": generate, "graphslot": graphslot, "reduce_overhead": reduce_overhead, "hf_cb": hf_cb}


def batch_case(rec: Recorder, s, bs: int, new_tokens: int) -> None:
    prompts = s.prompts[:bs].tolist()
    row: Dict[str, Any] = rec["batches"].setdefault(str(bs), {})
    ref = None
    for name, run in engines(s, prompts, new_tokens).items():
        got = rec.attempt(f"{name} bs {bs}", lambda run=run: timed_run(s.device, run))
        if got is None:
            continue
        if ref is None:  # generate runs first: the reference
            ref = {"tokens": got["tokens"], "margins": [[None] * new_tokens for _ in prompts]}
        check = compare(dict(enumerate(got["tokens"])), ref, {i: i for i in range(bs)})
        row[name] = {"seconds": got["seconds"], "tokens_per_s": bs * new_tokens / got["seconds"],
                     "ms_per_step": 1e3 * got["seconds"] / new_tokens, "equal": check["equal"],
                     "total": check["total"], "mismatches": check["mismatches"]}
        rec.save()
        print(f"proof_serving: bs {bs} {name} done", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = piece_args(__doc__.splitlines()[0], argv)
    os.environ.setdefault("GRAPHSLOT_MAX_KV_BYTES", str(KV_BYTES))  # bench_hf_decode's engine takes 0.6 of the GPU
    import bench_hf_decode

    device = target_device(args.smoke)
    rec = Recorder(args.result, **describe(device), batches={})
    start = time.perf_counter()
    s = bench_hf_decode.Setup(args.smoke, model=build_llama(args.smoke, device))
    rec.data.update(prompt_tokens=s.prompt, max_bs=s.max_bs, model_s=time.perf_counter() - start)
    s.compiled = bench_hf_decode.Compiled(s)
    gs = rec.attempt("graphslot capture", lambda: bench_hf_decode.Graphslot(s))
    if gs is not None:
        rec["graphslot_capture_s"] = gs.capture_s
    steps = 6 if args.smoke else 32
    rec["trace"] = rec.attempt("changing trace", functools.partial(bench_hf_decode.changing_trace, s, gs, s.compiled,
                                                                   steps))
    gs = None  # its KV pool and graphs go
    print("proof_serving: trace done", file=sys.stderr, flush=True)
    new_tokens = 4 if args.smoke else 32
    rec["new_tokens"] = new_tokens
    for bs in s.batch_sizes:
        batch_case(rec, s, bs, new_tokens)
    trace = rec["trace"] or {}
    ro = trace.get("reduce_overhead_per_size", {})
    rec["targets"] = {"ahead_of_reduce_overhead_on_trace": None if "graphslot_speedup_steady" not in ro else
                      ro["graphslot_speedup_steady"] > 1 and ro["graphslot_speedup_first_pass"] > 1}
    rec["seconds"] = time.perf_counter() - start
    return 0


if __name__ == "__main__":
    sys.exit(main())
