"""Serving throughput on the CPU: graphslot's ContinuousBatcher vs transformers' continuous batching vs generate.

    python benchmarks/bench_hf_serving.py [--shape small|issue] [--max-bs 8 32] [--ctx 128 2048]
        [--reps 3] [--context-buckets auto|128,512,2048] [--json PATH] [--smoke]

The model is a ``LlamaForCausalLM`` with random weights scaled by fan-in (as
:func:`graphslot.integrations.transformers.tiny_model`, so greedy argmax is never a
near-tie and every engine must produce the same tokens), fp32, sdpa:

* ``small``: hidden 256, 4 layers, 4/2 heads (head_dim 64), intermediate 688, vocab 32000 (19.3M parameters);
* ``issue``: hidden 512, 8 layers, 8/4 heads, intermediate 1024, vocab 32000, untied
  (51.65M parameters, the shape of the issue that asked for this benchmark).

The workload is ``--requests`` seeded requests (prompts of 16-64 tokens, 32-64 new
tokens each), greedy, EOS off, all queued at once. Engines:

* ``generate``: ``model.generate`` over chunks of ``max_bs`` requests, left-padded; each
  chunk runs to its longest ``max_new_tokens`` (``min_new_tokens`` the same, so EOS never
  cuts it) and the shorter requests' extra tokens are dropped (wasted work, as a static
  batch does);
* ``hf_cb``: transformers' ``ContinuousBatchingManager`` (``continuous_batching_context_manager``),
  ``max_requests_per_batch = max_bs``, ``num_blocks`` just enough, ``max_batch_tokens`` 2048;
* ``graphslot_ctx<L>``: ``ContinuousBatcher(max_bs, max_context_len=L)`` on the CPU tape
  backend; ``--context-buckets`` goes to the decode runner (``DecodeRunnerConfig.context_buckets``;
  default ``auto``, the engine's default; ``none``: one graph per batch size, every step
  gathering ``L``; lengths beyond ``L`` are dropped for that engine).

Timing. The machine may be shared, and wall time then measures the neighbours: each
engine's run is timed in **process CPU seconds** (all threads, HF CB's scheduler thread
included; torch uses ``--threads`` threads, default 1) and wall seconds side by side. One
run holds every engine; repetitions are interleaved (every engine once per repetition,
round-robin), the first repetition is a warm-up, and the median is reported, so
engines are compared under the same load. Setup (graphslot's capture, HF CB's manager
start) is outside the timed run and reported apart. tokens/s = new tokens / CPU seconds.
Every engine's tokens are checked equal to generate's, request by request.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

SHAPES = {
    "small": {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048},
    "issue": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
              "tie_word_embeddings": False},
    # --smoke: checks the script (tests/test_bench_hf_serving.py), measures nothing
    "smoke": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128},
}
Workload = List[Tuple[List[int], int]]  # (prompt, max_new_tokens)


def build_model(shape: str, seed: int = 0):
    """graphslot's ``tiny_model("llama")`` at ``shape`` (its fan-in scaled random weights), no EOS."""
    from graphslot.integrations.transformers import tiny_model

    dims = SHAPES[shape]
    model = tiny_model("llama", seed=seed, head_dim=dims["hidden_size"] // dims["num_attention_heads"], **dims,
                       bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return model


def workload(n: int, vocab: int, prompt: Tuple[int, int], new: Tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new)) for _ in range(n)]


class Clock:
    """Wall and process-CPU seconds at a point."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def since(self, start: Clock) -> Tuple[float, float]:
        return self.wall - start.wall, self.cpu - start.cpu


# -- engines: each is (setup, run); run returns the tokens and its (wall, cpu) ----------
def generate_engine(model, reqs: Workload, max_bs: int):
    def run():
        tokens, start = [], Clock()
        for i in range(0, len(reqs), max_bs):
            chunk = reqs[i:i + max_bs]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, (p, _) in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            n = max(k for _, k in chunk)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
            tokens += [out[j, width:width + k].tolist() for j, (_, k) in enumerate(chunk)]
        return tokens, Clock().since(start)
    return run


def cb_config_kwargs(config_class: Any, reqs: Workload, max_bs: int, page_size: int) -> Dict[str, Any]:
    """``ContinuousBatchingConfig``'s arguments, as the installed transformers names them:
    ``page_size`` was ``block_size`` before 5.20 or so (5.17, the GPU machine's, knows only
    ``block_size``), and ``auto_switch_to_flash`` (off here: sdpa, as the other engines)
    came with it."""
    params = inspect.signature(config_class.__init__).parameters
    kwargs: Dict[str, Any] = {"page_size" if "page_size" in params else "block_size": page_size}
    kwargs.update(num_blocks=sum(-(-(len(p) + n) // page_size) for p, n in reqs) + 4, max_batch_tokens=2048,
                  max_requests_per_batch=max_bs, allow_block_sharing=False, seed=0)
    if "auto_switch_to_flash" in params:
        kwargs["auto_switch_to_flash"] = False
    return kwargs


def hf_cb_engine(model, reqs: Workload, max_bs: int, page_size: int = 256):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    def run():
        gc = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=-1,
                              pad_token_id=0)
        cbc = ContinuousBatchingConfig(**cb_config_kwargs(ContinuousBatchingConfig, reqs, max_bs, page_size))
        outs = {}
        with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                       block=True, timeout=60) as manager:
            start = Clock()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in reqs]
            while len(outs) < len(ids):
                result = manager.get_result(timeout=5)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous batching: the manager's thread stopped")
                    continue
                if result.is_finished():
                    outs[result.request_id] = result
            took = Clock().since(start)
        return [list(outs[i].generated_tokens) for i in ids], took
    return run


class GraphslotEngine:
    """One ContinuousBatcher, built (and captured) once; each run serves the whole workload."""

    def __init__(self, model, reqs: Workload, max_bs: int, ctx: int, buckets: Any):
        from graphslot.integrations.transformers import ContinuousBatcher

        start = Clock()
        if isinstance(buckets, list):
            buckets = [n for n in buckets if n <= ctx] or None
        self.engine = ContinuousBatcher(model, max_bs=max_bs, max_context_len=ctx, backend="cpu", eos_token_id=(),
                                        context_buckets=buckets)
        for prompt, _ in reqs[:2]:  # the first eager prefill and replays, outside the timed runs
            self.engine.add_request(prompt, 2)
        while not self.engine.done:
            self.engine.step()
        self.setup_s = Clock().since(start)[0]
        self.reqs, self.steps = reqs, 0

    def __call__(self):
        start = Clock()
        reqs = [self.engine.add_request(p, n) for p, n in self.reqs]
        self.steps = 0
        while not self.engine.done:
            self.engine.step()
            self.steps += 1
        return [r.output for r in reqs], Clock().since(start)


def run(args) -> Dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = build_model(args.shape)
    smoke = args.shape == "smoke"
    reqs = workload(args.requests, model.config.vocab_size, (4, 12) if smoke else (16, 64),
                    (4, 12) if smoke else (32, 64))
    new_tokens = sum(n for _, n in reqs)
    buckets = args.context_buckets
    result: Dict[str, Any] = {
        "shape": args.shape, "parameters": sum(p.numel() for p in model.parameters()), "threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__, "requests": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs), "new_tokens": new_tokens, "reps": args.reps,
        "context_buckets": buckets,
        "runs": [],
    }
    cases: List[Tuple[int, str, Callable]] = []
    setup: Dict[Tuple[int, str], float] = {}
    for bs in args.max_bs:
        if "generate" in args.engines:
            cases.append((bs, "generate", generate_engine(model, reqs, bs)))
        if "hf_cb" in args.engines:
            cases.append((bs, "hf_cb", hf_cb_engine(model, reqs, bs)))
        if "graphslot" in args.engines:
            for ctx in args.ctx:
                engine = GraphslotEngine(model, reqs, bs, ctx, buckets)
                setup[(bs, f"graphslot_ctx{ctx}")] = engine.setup_s
                cases.append((bs, f"graphslot_ctx{ctx}", engine))
    times: Dict[Tuple[int, str], List[Tuple[float, float]]] = {(bs, name): [] for bs, name, _ in cases}
    tokens: Dict[Tuple[int, str], List[List[int]]] = {}
    for rep in range(args.reps + 1):  # rep 0 warms every engine up
        for bs, name, engine in cases:
            tokens[(bs, name)], took = engine()
            if rep:
                times[(bs, name)].append(took)
        print(f"bench_hf_serving: repetition {rep} of {args.reps} done", file=sys.stderr, flush=True)
    reference = {bs: tokens.get((bs, "generate")) for bs in args.max_bs}
    for bs, name, engine in cases:
        ref = reference[bs] or tokens[(args.max_bs[0], cases[0][1])]
        walls, cpus = zip(*times[(bs, name)]) if times[(bs, name)] else ((math.nan,), (math.nan,))
        cpu = statistics.median(cpus)
        row = {"max_bs": bs, "engine": name, "cpu_s": cpu, "wall_s": statistics.median(walls),
               "tok_per_cpu_s": new_tokens / cpu,
               "equal_to_generate": sum(a == b for a, b in zip(tokens[(bs, name)], ref)),
               "cpu_s_all": list(cpus), "wall_s_all": list(walls)}
        if (bs, name) in setup:
            row["setup_s"] = setup[(bs, name)]
            row["decode_steps"] = engine.steps
        result["runs"].append(row)
    result["ratios"] = ratios(result["runs"], args)
    return result


def ratios(runs: List[Dict[str, Any]], args) -> Dict[str, float]:
    """tokens/s of each graphslot case over generate's and HF CB's (> 1: graphslot is faster),
    and each max_bs's CPU time at the longest ctx over the shortest."""
    by = {(r["max_bs"], r["engine"]): r["cpu_s"] for r in runs}
    out = {}
    for bs in args.max_bs:
        for ctx in args.ctx:
            gs = by.get((bs, f"graphslot_ctx{ctx}"))
            for base in ("generate", "hf_cb"):
                if gs and (bs, base) in by:
                    out[f"bs{bs}_ctx{ctx}_vs_{base}"] = by[(bs, base)] / gs
        lo, hi = min(args.ctx), max(args.ctx)
        if lo != hi and (bs, f"graphslot_ctx{lo}") in by and (bs, f"graphslot_ctx{hi}") in by:
            out[f"bs{bs}_ctx{hi}_over_ctx{lo}"] = by[(bs, f"graphslot_ctx{hi}")] / by[(bs, f"graphslot_ctx{lo}")]
    return out


def format_report(r: Dict[str, Any]) -> str:
    title = (f"serving, CPU, torch {r['torch']}, transformers {r['transformers']}, {r['threads']} thread(s); "
             f"Llama '{r['shape']}' ({r['parameters'] / 1e6:.1f}M parameters, fp32); {r['requests']} requests, "
             f"{r['prompt_tokens']} prompt / {r['new_tokens']} new tokens; median of {r['reps']} interleaved "
             f"repetitions; context buckets: {r['context_buckets']}")
    header = (f"{'max_bs':>6}  {'engine':<20} {'CPU s':>8} {'wall s':>8} {'tok/CPU s':>10} {'= generate':>10} "
              f"{'setup s':>8} {'steps':>6}")
    lines = [title, header]
    for row in r["runs"]:
        lines.append(f"{row['max_bs']:>6}  {row['engine']:<20} {row['cpu_s']:8.3f} {row['wall_s']:8.3f} "
                     f"{row['tok_per_cpu_s']:10.1f} {row['equal_to_generate']:>5}/{r['requests']:<4} "
                     f"{row.get('setup_s', float('nan')):8.2f} {row.get('decode_steps', ''):>6}")
    lines.append("ratios (tokens/s of graphslot over the other; ctxH_over_ctxL: CPU time at the longest context "
                 "over the shortest):")
    lines += [f"  {name:<32} {value:.3f}" for name, value in r["ratios"].items()]
    return "\n".join(lines)


def parse_buckets(text: str) -> Any:
    if text in ("none", ""):
        return None
    if text == "auto":
        return "auto"
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context-buckets takes 'auto', 'none' or lengths like 128,512,2048, "
                                         f"got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few requests: checks the script")
    parser.add_argument("--max-bs", type=int, nargs="+", default=None)
    parser.add_argument("--ctx", type=int, nargs="+", default=None, help="graphslot's max_context_len values")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (after one warm-up)")
    parser.add_argument("--engines", nargs="+", default=["generate", "hf_cb", "graphslot"],
                        choices=["generate", "hf_cb", "graphslot"])
    parser.add_argument("--context-buckets", type=parse_buckets, default="auto",
                        help="'auto' (the default), 'none' or lengths (128,512,2048): "
                             "DecodeRunnerConfig.context_buckets")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shape = "smoke"
    small = args.shape == "smoke"
    args.max_bs = args.max_bs or ([2, 4] if small else [8, 32])
    args.ctx = args.ctx or ([32, 128] if small else [128, 2048])
    args.requests = args.requests or (6 if small else 32)
    args.reps = args.reps if args.reps is not None else (1 if small else 3)
    with contextlib.redirect_stdout(sys.stderr):  # transformers' own prints stay off the report
        result = run(args)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    worst = min(row["equal_to_generate"] for row in result["runs"])
    return 0 if worst == result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
