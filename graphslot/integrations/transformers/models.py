"""Tiny random-weight models of the tested families, and plain transformers decode to check against.

Nothing is downloaded: each recipe of :data:`FAMILIES` builds its family's config class
with a few-layer shape (2 layers, hidden 64, vocab 128) and the weights are drawn from a
private seeded generator (the global RNG is left as it was). Each tiny config exercises
what its family adds: sliding windows on every layer (Mistral) or some (Qwen2, Gemma2/3),
q/k norms, multi-query attention (GPT-BigCode, Falcon-7B style), K and V broadcast to
every head (Falcon's new architecture), compressed MLA latents whose K and V widths
differ (DeepSeek-V2/V3, MiniCPM3), alibi from a 2-D mask (Bloom, Falcon-RW), learnt
positions (GPT-2, OPT), mixtures of experts (Mixtral, Qwen2-MoE, GPT-OSS).

:data:`TESTED_FAMILIES` is the ``model_type`` of every recipe: exactly what
tests/test_hf_families.py runs (each recipe against transformers per request and
``model.generate``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, NamedTuple, Optional

import torch
import transformers

from .forward import with_cache


class Recipe(NamedTuple):
    """How to build one family's tiny model."""

    model_type: str
    config_class: str
    model_class: str
    #: The config's arguments (the family's own names).
    config: Dict[str, Any]
    #: The attention implementation it runs with; None: sdpa where the family has it, else eager.
    attn_implementation: Optional[str] = None


_VOCAB = 128
_POSITIONS = 64
#: The common shape, in the names Llama-like configs take.
TINY_SHAPE = dict(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=_POSITIONS)
_GPT2_SHAPE = dict(vocab_size=_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=_POSITIONS)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(TINY_SHAPE, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16)


def _llama_like(model_type: str, name: str, **extra: Any) -> Recipe:
    return Recipe(model_type, f"{name}Config", f"{name}ForCausalLM", {**TINY_SHAPE, **extra})


#: recipe name (``graphslot demo --model hf-<name>``) -> :class:`Recipe`.
FAMILIES: Dict[str, Recipe] = {
    "llama": _llama_like("llama", "Llama"),
    "mistral": _llama_like("mistral", "Mistral", sliding_window=8),
    "qwen2": _llama_like("qwen2", "Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": _llama_like("qwen3", "Qwen3"),
    "gemma": _llama_like("gemma", "Gemma"),
    "gemma2": _llama_like("gemma2", "Gemma2", sliding_window=8),
    "gemma3_text": Recipe("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
                          dict(TINY_SHAPE, sliding_window=8, sliding_window_pattern=2)),
    "phi3": _llama_like("phi3", "Phi3", pad_token_id=0),
    "starcoder2": _llama_like("starcoder2", "Starcoder2", sliding_window=8),
    "cohere": _llama_like("cohere", "Cohere"),
    "olmo2": _llama_like("olmo2", "Olmo2"),
    "granite": _llama_like("granite", "Granite"),
    "stablelm": _llama_like("stablelm", "StableLm"),
    "phi": _llama_like("phi", "Phi"),
    "mixtral": _llama_like("mixtral", "Mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _llama_like("qwen2_moe", "Qwen2Moe", num_experts=4, shared_expert_intermediate_size=32, **_MOE),
    "gpt_oss": _llama_like("gpt_oss", "GptOss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "deepseek_v2": Recipe("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
                          dict(_MLA, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE)),
    "deepseek_v3": Recipe("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",  # rotary over the rope part
                          dict(_MLA, head_dim=8, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                               **_MOE)),
    "minicpm3": Recipe("minicpm3", "MiniCPM3Config", "MiniCPM3ForCausalLM", dict(_MLA)),
    "gpt2": Recipe("gpt2", "GPT2Config", "GPT2LMHeadModel", _GPT2_SHAPE),
    "gpt_bigcode": Recipe("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                          dict(_GPT2_SHAPE, multi_query=True)),
    "gptj": Recipe("gptj", "GPTJConfig", "GPTJForCausalLM", dict(_GPT2_SHAPE, rotary_dim=8)),
    "gpt_neox": Recipe("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
                       dict(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=_POSITIONS)),
    "opt": Recipe("opt", "OPTConfig", "OPTForCausalLM",
                  dict(vocab_size=_VOCAB, hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=_POSITIONS)),
    "biogpt": Recipe("biogpt", "BioGptConfig", "BioGptForCausalLM",
                     dict(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=_POSITIONS)),
    "xglm": Recipe("xglm", "XGLMConfig", "XGLMForCausalLM",
                   dict(vocab_size=_VOCAB, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                        max_position_embeddings=_POSITIONS)),
    "ctrl": Recipe("ctrl", "CTRLConfig", "CTRLLMHeadModel", dict(_GPT2_SHAPE, dff=128)),
    "mpt": Recipe("mpt", "MptConfig", "MptForCausalLM",
                  dict(vocab_size=_VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=_POSITIONS)),
    "bloom": Recipe("bloom", "BloomConfig", "BloomForCausalLM", dict(vocab_size=_VOCAB, hidden_size=64, n_layer=2,
                                                                    n_head=4)),
    "falcon": Recipe("falcon", "FalconConfig", "FalconForCausalLM",  # falcon-40b style: K/V broadcast to every head
                     dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          new_decoder_architecture=True, num_kv_heads=2, alibi=False, max_position_embeddings=64)),
    "falcon-mqa": Recipe("falcon", "FalconConfig", "FalconForCausalLM",  # falcon-7b style: one KV head
                         dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=False, multi_query=True, alibi=False,
                              max_position_embeddings=64)),
    "falcon-alibi": Recipe("falcon", "FalconConfig", "FalconForCausalLM",  # falcon-rw style: alibi, 2-D mask
                           dict(vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                new_decoder_architecture=False, multi_query=False, alibi=True)),
}

#: ``config.model_type`` of the families the tests cover (one or more recipes each).
TESTED_FAMILIES = tuple(dict.fromkeys(recipe.model_type for recipe in FAMILIES.values()))

#: Tolerance of the per-request comparison (fp32 on the CPU; batching changes the
#: reduction order of the matmuls, so rows are close, not identical).
ATOL = 1e-4
RTOL = 1e-4


def _recipe(family: str) -> Recipe:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; tested: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def tiny_config(family: str, **overrides: Any):
    recipe = _recipe(family)
    return getattr(transformers, recipe.config_class)(**{**recipe.config, **overrides})


def _scale_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Draw every parameter: embeddings N(0, 1), norm scales 1 + N(0, 0.1), biases and other
    vectors N(0, 0.1), matrices N(0, 1.5 / fan_in) (``Conv1D`` stores ``[in, out]``)."""
    seen = set()
    for module in model.modules():
        norm = "norm" in type(module).__name__.lower()
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # tied (an untied lm_head is a matrix like any other)
                continue
            seen.add(id(p))
            if isinstance(module, torch.nn.Embedding):
                value = torch.randn(p.shape, generator=gen)
            elif norm and name == "weight":
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif p.dim() >= 2:
                fan_in = p.shape[0] if type(module).__name__ == "Conv1D" else p.shape[-1]
                value = torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in))
            else:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(value)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None, attn_implementation: Optional[str] = None, **overrides: Any):
    """A random-weight model of a :data:`FAMILIES` recipe, in eval mode.

    transformers' own init (std 0.02) makes near-uniform attention, where a wrong mask
    hardly shows; weights here are scaled by fan-in so attention is peaked and every
    position a row sees matters.
    """
    recipe = _recipe(family)
    config = tiny_config(family, **overrides)
    cls = getattr(transformers, recipe.model_class)
    config._attn_implementation = (attn_implementation or recipe.attn_implementation
                                   or ("sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    with torch.no_grad():
        _scale_weights(model, torch.Generator().manual_seed(seed))
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
            out = self.model(input_ids=ids, **with_cache(self.model, self.caches[rid]), use_cache=True)
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
