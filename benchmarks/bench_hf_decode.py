"""A transformers model's decode step: HF eager vs torch.compile(reduce-overhead) vs graphslot.

    python benchmarks/bench_hf_decode.py [--smoke] [--json PATH]

The model is a ``LlamaForCausalLM`` at a 1B-like shape (hidden 2048, 16 layers, 32
heads / 8 KV heads, vocab 128256, bf16, random weights: nothing is downloaded). Every
request has a 256-token prompt; a decode step feeds one token per request at position
256 and picks the next token greedily (argmax on the device, then ``.tolist()``, which
waits for the step). The step is the same for all three, timed from the host:

* ``hf eager``: ``model(...)`` with a ``DynamicCache`` (cropped back after each step);
* ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead", fullgraph=True)``
  with a ``StaticCache`` per batch size (CUDAGraph Trees: what an HF user picks today);
  "compile" is the wall time of its first three calls at a size (compile, recompile,
  recording);
* ``graphslot``: ``graphslot.integrations.transformers`` -- a paged cache and the decode
  graph runner, every default size up to 32 captured once ("compile" is that capture).

Then the case serving meets: the batch size changes every step (a seeded trace of sizes
1..32). reduce-overhead either keeps one graph per size (one StaticCache per size, a
recompile and a recording whenever a size is new) or pads every step to 32; graphslot
pads to its next captured size. Memory is ``torch.cuda.memory_reserved`` /
``memory_allocated`` growth over compile or capture. ``--smoke`` runs a tiny fp32 model
on the CPU (the tape backend; compile with Dynamo's eager backend, so no graphs) to check
the script itself (tests/test_bench_hf_decode.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

PROMPT = 256
#: Cache positions beyond the prompt: room for the steps a StaticCache advances through
#: between resets. Both caches span prompt + HEADROOM positions, so attention does the
#: same work in both (each attends over its whole length, masked).
HEADROOM = 256
FULL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
            tie_word_embeddings=True)
SMOKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


class Setup:
    """The model (``model``: one of that shape, dtype and device, e.g. gpu_proof's with
    fan-in scaled weights; default: transformers' init), prompts and sizes."""

    def __init__(self, smoke: bool, seed: int = 0, model: Any = None):
        import transformers

        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.prompt = 16 if smoke else PROMPT
        self.context = self.prompt + (64 if smoke else HEADROOM)
        self.max_bs = 4 if smoke else 32
        self.batch_sizes = [1, 2, 4] if smoke else [1, 8, 32]
        self.steps = 5 if smoke else 30
        if model is None:
            config = transformers.LlamaConfig(**(SMOKE if smoke else FULL))
            config._attn_implementation = "sdpa"
            torch.manual_seed(seed)
            with torch.device(self.device):
                model = transformers.LlamaForCausalLM(config).to(self.dtype).eval()
        self.model = model
        self.config = model.config
        gen = torch.Generator().manual_seed(seed)
        self.prompts = torch.randint(1, self.config.vocab_size, (self.max_bs, self.prompt), generator=gen)
        self.fed = torch.randint(1, self.config.vocab_size, (self.max_bs,), generator=gen).tolist()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def memory(self) -> Dict[str, int]:
        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0}
        self.sync()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}

    def ids(self, bs: int) -> torch.Tensor:
        return torch.tensor(self.fed[:bs], device=self.device).view(bs, 1)

    def timed(self, step: Callable[[], Any], n: int) -> List[float]:
        """Per-call seconds of ``n`` steps (each ends reading its tokens on the host)."""
        times = []
        for _ in range(n):
            self.sync()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times


def grown(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before[k] for k in before}


# -- hf eager -------------------------------------------------------------------------
def hf_eager(s: Setup, bs: int) -> Dict[str, Any]:
    import transformers

    cache = transformers.DynamicCache(config=s.config)
    with torch.no_grad():
        s.model(input_ids=s.prompts[:bs].to(s.device), past_key_values=cache, use_cache=True)
    position = torch.full((bs, 1), s.prompt, device=s.device)
    times = []

    def step():
        with torch.no_grad():
            out = s.model(input_ids=s.ids(bs), position_ids=position, past_key_values=cache, use_cache=True)
        return out.logits[:, -1].argmax(-1).tolist()

    logits = None
    for _ in range(2 + s.steps):
        times += s.timed(step, 1)
        cache.crop(-1)
    with torch.no_grad():
        logits = s.model(input_ids=s.ids(bs), position_ids=position, past_key_values=cache,
                         use_cache=True).logits[:, -1].float()
    cache.crop(-1)
    return {"step_ms": 1e3 * statistics.median(times[2:]), "logits": logits}


# -- torch.compile(mode="reduce-overhead") with StaticCache ---------------------------
class Compiled:
    def __init__(self, s: Setup):
        import transformers

        self.s, self.transformers = s, transformers
        backend = "eager" if s.smoke else "inductor"
        options = {} if s.smoke else {"mode": "reduce-overhead"}
        self.forward = torch.compile(s.model, fullgraph=True, backend=backend, **options)
        self.caches: Dict[int, Any] = {}

    def cache(self, bs: int) -> Any:
        """A StaticCache of ``bs`` rows holding the prompts (prefilled eagerly)."""
        if bs not in self.caches:
            s = self.s
            cache = self.transformers.StaticCache(config=s.config, max_cache_len=s.context)
            with torch.no_grad():
                s.model(input_ids=s.prompts[:bs].to(s.device), past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(s.prompt, device=s.device))
            self.caches[bs] = cache
        return self.caches[bs]

    def rewind(self) -> None:
        """Back to the prompt's end: transformers >= 5.20 advances a StaticCache's write
        position itself (``cumulative_length``), and a long run must not overflow it."""
        for cache in self.caches.values():
            for layer in cache.layers:
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(self.s.prompt)

    def step(self, bs: int, rows: int | None = None) -> List[int]:
        """One decode step of ``bs`` requests, run as ``rows`` (>= bs: padded) rows."""
        s, rows = self.s, rows or bs
        cache = self.cache(rows)
        position = torch.full((rows, 1), s.prompt, device=s.device)
        if not s.smoke:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = self.forward(input_ids=s.ids(rows), position_ids=position, past_key_values=cache, use_cache=True,
                               cache_position=torch.tensor([s.prompt], device=s.device))
        return out.logits[:bs, -1].argmax(-1).tolist()

    def measure(self, bs: int) -> Dict[str, Any]:
        s = self.s
        self.cache(bs)
        self.rewind()
        before = s.memory()
        first = s.timed(lambda: self.step(bs), 3)
        mem = grown(before, s.memory())
        times = s.timed(lambda: self.step(bs), s.steps)
        return {"step_ms": 1e3 * statistics.median(times), "compile_s": sum(first), "memory": mem}


# -- graphslot ------------------------------------------------------------------------
class Graphslot:
    """The paged cache and the decode runner over ``model`` (``s.model``, or a compiled
    one: inductor's kernels in graphslot's graphs)."""

    def __init__(self, s: Setup, model: Any = None):
        from graphslot.integrations.transformers import ContinuousBatcher, DecodeStep

        self.s, self.DecodeStep = s, DecodeStep
        before = s.memory()
        # No EOS: every request must still be running after the first step, whatever it drew.
        self.engine = ContinuousBatcher(s.model if model is None else model, max_bs=s.max_bs, max_context_len=s.context,
                                        backend="cpu" if s.smoke else "cuda", eos_token_id=())
        self.memory = grown(before, s.memory())
        pool = self.engine.cache.pool
        self.memory["kv_pool"] = sum(t.numel() * t.element_size() for t in pool.k_buffer + pool.v_buffer)
        self.capture_s = self.engine.runner.capture_seconds
        for prompt in s.prompts.tolist():
            self.engine.add_request(prompt, max_new_tokens=8)
        self.engine.step()  # prefill every request, and a first decode: position `prompt` holds a slot
        self.reqs = list(self.engine.running)

    def batch(self, bs: int) -> Any:
        """Requests 0..bs-1 decoding at position ``prompt`` again (its slot is rewritten)."""
        s, dev, reqs = self.s, self.s.device, self.reqs[:bs]

        def i64(values, device=dev):
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens = [s.prompt + 1] * bs
        return self.DecodeStep(input_ids=i64(s.fed[:bs]), positions=i64([s.prompt] * bs),
                               out_cache_loc=i64([r.slots[s.prompt] for r in reqs]),
                               req_pool_indices=i64([r.row for r in reqs]), seq_lens=i64(lens),
                               seq_lens_cpu=i64(lens, "cpu"), batch_size=bs)

    def step(self, bs: int) -> List[int]:
        return self.engine.runner(self.batch(bs)).argmax(-1).tolist()

    def measure(self, bs: int) -> Dict[str, Any]:
        s = self.s
        s.timed(lambda: self.step(bs), 2)
        times = s.timed(lambda: self.step(bs), s.steps)
        logits = self.engine.runner(self.batch(bs)).float().clone()
        return {"step_ms": 1e3 * statistics.median(times), "logits": logits}


def agreement(got: torch.Tensor, want: torch.Tensor) -> Dict[str, float]:
    return {"max_abs_diff": float((got - want).abs().max()),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean())}


def attempt(errors: Dict[str, str], name: str, fn: Callable[[], Any]) -> Any:
    """Run one case; a failure is recorded (and printed) instead of ending the run."""
    try:
        return fn()
    except Exception as exc:  # a benchmark reports what broke and goes on
        errors[name] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        return None


def run(smoke: bool, trace_steps: int, save: Callable[[Dict[str, Any]], None] = lambda r: None) -> Dict[str, Any]:
    """All figures; ``save`` gets the result so far after each case (a run cut short
    keeps what it measured)."""
    import transformers

    s = Setup(smoke)
    errors: Dict[str, str] = {}
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {k: getattr(s.config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "vocab_size")},
        "dtype": str(s.dtype).removeprefix("torch."), "prompt_tokens": s.prompt, "steps": s.steps,
        "compile": "dynamo eager backend (smoke: no graphs)" if smoke else "inductor, mode=reduce-overhead",
        "batch": {}, "errors": errors,
    }
    gs = attempt(errors, "graphslot capture", lambda: Graphslot(s))
    if gs is not None:
        result["graphslot_capture"] = {"sizes": list(gs.engine.runner.captured_sizes), "seconds": gs.capture_s,
                                       "memory": gs.memory}
    compiled = Compiled(s)
    for bs in s.batch_sizes:
        row: Dict[str, Any] = result["batch"].setdefault(str(bs), {})
        eager = attempt(errors, f"hf eager bs {bs}", lambda: hf_eager(s, bs))
        if eager:
            row["hf_eager_ms"] = eager["step_ms"]
        if gs is not None and (got := attempt(errors, f"graphslot bs {bs}", lambda: gs.measure(bs))):
            row["graphslot_ms"] = got["step_ms"]
            if eager:
                row["graphslot_vs_hf_eager"] = agreement(got["logits"], eager["logits"])
        comp = attempt(errors, f"reduce-overhead bs {bs}", lambda: compiled.measure(bs))
        if comp:
            row.update(reduce_overhead_ms=comp["step_ms"], reduce_overhead_compile_s=comp["compile_s"],
                       reduce_overhead_memory=comp["memory"])
        for name in ("hf_eager_ms", "reduce_overhead_ms"):
            if name in row and "graphslot_ms" in row:
                row[f"graphslot_speedup_vs_{name[:-3]}"] = row[name] / row["graphslot_ms"]
        print(f"bench_hf_decode: batch size {bs} done", file=sys.stderr)
        save(result)
    result["trace"] = attempt(errors, "changing batch size", lambda: changing_trace(s, gs, compiled, trace_steps))
    save(result)
    # Last, as the riskiest: inductor's kernels (no CUDA graphs of its own) inside graphslot's graphs.
    inductor = torch.compile(s.model, dynamic=True, **({"backend": "eager"} if smoke else {}))
    gc_ = attempt(errors, "graphslot over torch.compile", lambda: Graphslot(s, inductor))
    if gc_ is not None:
        result["graphslot_compiled_capture"] = {"seconds": gc_.capture_s, "memory": gc_.memory}
        for bs in s.batch_sizes:
            got = attempt(errors, f"graphslot over torch.compile bs {bs}", lambda: gc_.measure(bs))
            if got:
                result["batch"][str(bs)]["graphslot_compiled_ms"] = got["step_ms"]
    save(result)
    return result


def changing_trace(s: Setup, gs: Graphslot | None, compiled: Compiled, steps: int) -> Dict[str, Any]:
    """A new batch size every step: total and steady time per step for each approach."""
    rng = random.Random(1)
    sizes = [rng.randint(1, s.max_bs) for _ in range(steps)]
    out: Dict[str, Any] = {"steps": steps, "distinct_sizes": len(set(sizes))}

    def run_trace(step: Callable[[int], Any]) -> Dict[str, float]:
        compiled.rewind()
        first = sum(s.timed(lambda: [step(bs) for bs in sizes], 1))
        compiled.rewind()
        again = sum(s.timed(lambda: [step(bs) for bs in sizes], 1))
        return {"first_pass_ms_per_step": 1e3 * first / steps, "steady_ms_per_step": 1e3 * again / steps}

    if gs is not None:
        out["graphslot"] = run_trace(gs.step)
    for bs in sorted(set(sizes)):
        compiled.cache(bs)  # prefills are not the compiler's cost
    compiled.cache(s.max_bs)
    before = s.memory()
    out["reduce_overhead_per_size"] = run_trace(compiled.step)
    out["reduce_overhead_per_size"]["memory"] = grown(before, s.memory())
    out["reduce_overhead_padded_to_max"] = run_trace(lambda bs: compiled.step(bs, rows=s.max_bs))
    if "graphslot" in out:
        g = out["graphslot"]["steady_ms_per_step"]
        for name in ("reduce_overhead_per_size", "reduce_overhead_padded_to_max"):
            out[name]["graphslot_speedup_first_pass"] = out[name]["first_pass_ms_per_step"] / out["graphslot"][
                "first_pass_ms_per_step"]
            out[name]["graphslot_speedup_steady"] = out[name]["steady_ms_per_step"] / g
    return out


def format_report(r: Dict[str, Any]) -> str:
    m = r["model"]
    lines = [f"decode step, {r['device']}, torch {r['torch']}, transformers {r['transformers']}, "
             f"LlamaForCausalLM hidden {m['hidden_size']} x {m['num_hidden_layers']} layers, "
             f"{m['num_attention_heads']}/{m['num_key_value_heads']} heads, vocab {m['vocab_size']}, {r['dtype']}, "
             f"{r['prompt_tokens']}-token context; compile: {r['compile']}"]
    cap = r.get("graphslot_capture")
    if cap:
        lines.append(f"graphslot capture: sizes {cap['sizes']} in {cap['seconds']:.2f} s, allocated "
                     f"+{(cap['memory']['allocated'] - cap['memory']['kv_pool']) / 2**20:.0f} MiB beside the "
                     f"{cap['memory']['kv_pool'] / 2**20:.0f} MiB KV pool "
                     f"(reserved {cap['memory']['reserved'] / 2**20:+.0f} MiB: capture empties the allocator's cache)")
    lines.append(f"{'bs':>4}  {'hf eager':>10}  {'reduce-ovh':>10}  {'graphslot':>10}  {'vs eager':>8}  "
                 f"{'vs r-o':>7}  {'r-o compile':>11}  {'r-o reserved':>12}  {'top1 agree':>10}")

    def ms(v):
        return f"{v:8.3f}ms" if v is not None else f"{'-':>10}"

    for bs, row in r["batch"].items():
        mem = row.get("reduce_overhead_memory", {}).get("reserved")
        agree = row.get("graphslot_vs_hf_eager", {}).get("top1_agreement")
        vs_e, vs_r = row.get("graphslot_speedup_vs_hf_eager"), row.get("graphslot_speedup_vs_reduce_overhead")
        lines.append(f"{bs:>4}  {ms(row.get('hf_eager_ms'))}  {ms(row.get('reduce_overhead_ms'))}  "
                     f"{ms(row.get('graphslot_ms'))}  {f'{vs_e:7.2f}x' if vs_e else '-':>8}  "
                     f"{f'{vs_r:6.2f}x' if vs_r else '-':>7}  "
                     f"{row.get('reduce_overhead_compile_s', float('nan')):10.2f}s  "
                     f"{(mem or 0) / 2**20:9.0f} MiB  {agree if agree is not None else '-':>10}")
    t = r.get("trace")
    if t:
        lines.append(f"batch size changing every step ({t['steps']} steps, {t['distinct_sizes']} distinct sizes), "
                     "ms per step, first pass / steady:")
        for name in ("graphslot", "reduce_overhead_per_size", "reduce_overhead_padded_to_max"):
            if name in t:
                v = t[name]
                extra = "" if name == "graphslot" else (
                    f"  graphslot {v['graphslot_speedup_first_pass']:.1f}x / {v['graphslot_speedup_steady']:.2f}x "
                    "faster" if "graphslot_speedup_steady" in v else "")
                lines.append(f"  {name:<30} {v['first_pass_ms_per_step']:9.3f} / {v['steady_ms_per_step']:.3f}{extra}")
    gcap = r.get("graphslot_compiled_capture")
    if gcap:
        per = ", ".join(f"bs {bs} {row['graphslot_compiled_ms']:.3f} ms" for bs, row in r["batch"].items()
                        if "graphslot_compiled_ms" in row)
        lines.append(f"graphslot over torch.compile (inductor kernels, graphslot's graphs): capture with "
                     f"compile {gcap['seconds']:.1f} s; {per}")
    for name, err in r["errors"].items():
        lines.append(f"error in {name}: {err}")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--trace-steps", type=int, default=None, help="steps of the changing-size trace")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_hf_decode: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1
    def save(result: Dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)

    result = run(args.smoke, args.trace_steps or (6 if args.smoke else 64), save)
    print(format_report(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
