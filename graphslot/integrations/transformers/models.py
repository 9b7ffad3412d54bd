"""Tiny random-weight models of the tested families, and plain transformers decode to check against.

Nothing is downloaded: each family's config class is built with a few-layer shape and
the weights are drawn from a private seeded generator (the global RNG is left as it
was). Each tiny config exercises what its family adds: Mistral a sliding window on
every layer, Qwen2 a window on some layers only (a mask per layer type), Qwen3 its
q/k norms and an explicit ``head_dim``; all use grouped-query attention.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import transformers

#: family -> (config class, model class, what the tiny config sets beyond the common shape)
FAMILIES: Dict[str, tuple] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}

TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)

#: Tolerance of the per-request comparison (fp32 on the CPU; batching changes the
#: reduction order of the matmuls, so rows are close, not identical).
ATOL, RTOL = 1e-5, 1e-4


def tiny_config(family: str, **overrides: Any):
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; tested: {', '.join(FAMILIES)}")
    config_name, _, extra = FAMILIES[family]
    return getattr(transformers, config_name)(**{**TINY_SHAPE, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None, attn_implementation: str = "sdpa", **overrides: Any):
    """A random-weight ``<Family>ForCausalLM`` in eval mode.

    transformers' own init (std 0.02) makes near-uniform attention, where a wrong mask
    hardly shows; weights here are scaled by fan-in so attention is peaked and every
    position a row sees matters.
    """
    config = tiny_config(family, **overrides)
    config._attn_implementation = attn_implementation
    cls = getattr(transformers, FAMILIES[family][1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[1])))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else 0.1))
    return model.to(device=device or "cpu", dtype=dtype).eval()


class PerRequestHF:
    """Plain transformers decode, one request at a time with its own ``DynamicCache``:
    what the engine's rows are compared with."""

    def __init__(self, model: Any):
        self.model = model
        self.caches: Dict[int, Any] = {}

    def _run(self, rid: int, tokens) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.int64, device=self.model.device)
        with torch.no_grad():
            out = self.model(input_ids=ids, past_key_values=self.caches[rid], use_cache=True)
        return out.logits[0, -1]

    def prefill(self, rid: int, prompt) -> torch.Tensor:
        """Logits after the prompt (``[vocab]``)."""
        self.caches[rid] = transformers.DynamicCache(config=self.model.config)
        return self._run(rid, prompt)

    def decode(self, rid: int, token: int) -> torch.Tensor:
        """Logits after feeding ``token``."""
        return self._run(rid, [token])

    def drop(self, rid: int) -> None:
        self.caches.pop(rid, None)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), atol=ATOL, rtol=RTOL)
