"""What the pieces of benchmarks/gpu_proof.py share: the result file, the model, greedy references.

Each piece runs in its own process (``python3 benchmarks/proof_<piece>.py --result PATH
[--smoke]``) and writes its figures to ``PATH`` after every case (:class:`Recorder`), so a
piece killed at its deadline, or by a CUDA error, keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

#: Llama-3.2-1B's shape (random weights): bench_hf_decode's, so the figures compare.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                tie_word_embeddings=True)
LLAMA_SMOKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
NA = None  # a figure this device cannot give


class Recorder:
    """A piece's result: a dict written (atomically) to ``path`` at every :meth:`save`."""

    def __init__(self, path: str, **fields: Any):
        self.path = path
        self.data: Dict[str, Any] = {"errors": {}, **fields}
        self.save()

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def attempt(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; an exception is recorded under ``errors[name]`` (and printed), not raised."""
        try:
            return fn()
        except Exception as exc:  # a piece reports what broke and goes on
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            self.save()
            return None


def piece_args(description: str, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--result", required=True, help="where the piece writes its JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the tape backend)")
    parser.add_argument("--what", default=None, help="which case of the piece (some pieces have several)")
    return parser.parse_args(argv)


def target_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("this piece needs a CUDA GPU (or --smoke)")
    return torch.device("cuda")


def describe(device: torch.device) -> Dict[str, Any]:
    import platform

    found = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
             "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    if device.type != "cuda":
        found["null_figures"] = ("CUDA only (kernel launches, GPU time, the CUDA allocator's memory): no CUDA device "
                                 "here (--smoke: the CPU tape backend)")
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def memory(device: torch.device) -> Dict[str, Optional[int]]:
    if device.type != "cuda":
        return {"allocated": NA, "reserved": NA}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def grown(before: Dict[str, Optional[int]], after: Dict[str, Optional[int]]) -> Dict[str, Optional[int]]:
    return {k: NA if before[k] is None else after[k] - before[k] for k in before}


def build_llama(smoke: bool, device: torch.device, seed: int = 0):
    """A ``LlamaForCausalLM`` at the 1B shape (bf16; smoke: tiny, fp32) with graphslot's
    fan-in scaled random weights (``tiny_model``'s: peaked logits, so greedy argmax is
    rarely a near-tie), drawn on ``device`` (seconds, not the minute a CPU draw of 1.2B
    parameters takes). No EOS: every request runs to its ``max_new_tokens``."""
    import transformers
    from graphslot.integrations.transformers.models import _scale_weights, tiny_config

    config = tiny_config("llama", **(LLAMA_SMOKE if smoke else LLAMA_1B))
    config._attn_implementation = "sdpa"
    with torch.device(device), torch.no_grad():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        _scale_weights(model, torch.Generator(device=device).manual_seed(seed))
    model = model.to(torch.float32 if smoke else torch.bfloat16).eval()
    gen = model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = 0
    gen.do_sample = False
    return model


def prompts_of(n: int, lengths: Sequence[int], vocab: int, seed: int = 0) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def reference(model, prompts: List[List[int]], new_tokens: int) -> Dict[str, Any]:
    """``generate``'s greedy tokens for each prompt (batched when the prompts are of one
    length, else one by one: no padding either way) and, per token, the margin between
    the best and second-best logit (what a bf16 rounding difference must beat to flip it)."""
    tokens: List[List[int]] = []
    margins: List[List[float]] = []
    groups: Dict[int, List[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    out_tokens: Dict[int, List[int]] = {}
    out_margins: Dict[int, List[float]] = {}
    for length, idx in groups.items():
        for start in range(0, len(idx), 32):
            chunk = idx[start:start + 32]
            ids = torch.tensor([prompts[i] for i in chunk], device=model.device)
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                     return_dict_in_generate=True, output_scores=True)
            top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores], 1)  # [b, steps, 2]
            gaps = (top2[..., 0] - top2[..., 1]).tolist()
            for row, i in enumerate(chunk):
                out_tokens[i] = out.sequences[row, length:].tolist()
                out_margins[i] = gaps[row]
    for i in range(len(prompts)):
        tokens.append(out_tokens[i])
        margins.append(out_margins[i])
    return {"tokens": tokens, "margins": margins}


def compare(got: Dict[int, List[int]], ref: Dict[str, Any], which: Dict[int, int]) -> Dict[str, Any]:
    """``got[r]`` (request r's tokens) against the reference of prompt ``which[r]``, as far
    as ``got`` goes. A mismatch names its first differing token and the reference's margin there."""
    mismatches = []
    for r, tokens in got.items():
        want = ref["tokens"][which[r]][:len(tokens)]
        if tokens != want:
            at = next(i for i, (a, b) in enumerate(zip(tokens + [None], want + [None])) if a != b)
            margin = ref["margins"][which[r]][at] if at < len(want) else None
            mismatches.append({"request": r, "prompt": which[r], "first_diff": at, "ref_margin": margin})
    return {"equal": len(got) - len(mismatches), "total": len(got), "mismatches": mismatches[:8]}


def ro_generate(forward: Callable, model, prompts: List[List[int]], new_tokens: int, context: int,
                graphs: bool) -> List[List[int]]:
    """Greedy tokens of equal-length ``prompts`` with a ``StaticCache``: the prompt eagerly,
    each further token through ``forward`` (``torch.compile(mode="reduce-overhead")``:
    CUDAGraph Trees when ``graphs``), as an HF user decodes with a compiled model."""
    import transformers

    bs = len(prompts)
    length = len(prompts[0])
    dev = model.device
    cache = transformers.StaticCache(config=model.config, max_cache_len=context)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(prompts, device=dev), past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(length, device=dev)).logits[:, -1]
        token = logits.argmax(-1)
        out = [token]
        for i in range(new_tokens - 1):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            pos = length + i
            logits = forward(input_ids=token.view(bs, 1), position_ids=torch.full((bs, 1), pos, device=dev),
                             past_key_values=cache, use_cache=True,
                             cache_position=torch.tensor([pos], device=dev)).logits[:, -1]
            token = logits.argmax(-1)  # eager: the graph's output is overwritten by its next replay
            out.append(token)
    return torch.stack(out, 1).tolist()


def reduce_overhead(model, smoke: bool) -> Callable:
    """``torch.compile(model, mode="reduce-overhead", fullgraph=True)``; smoke: Dynamo's
    eager backend (no graphs on the CPU)."""
    return torch.compile(model, fullgraph=True, **({"backend": "eager"} if smoke else {"mode": "reduce-overhead"}))

