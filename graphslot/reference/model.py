"""A tiny Llama-shaped model over the paged backend, and a factory that wires it up.

The model is split into ``embed`` / ``layers`` / ``logits`` so a prefill runner can
capture the layer stack on its own. Weights come from a private seeded generator on
the CPU and are then moved, so the same seed gives bit-identical weights on any device
and never disturbs the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import nn

from .attention import TorchAttentionBackend
from .forward_batch import ForwardBatch
from ..kvpool import PagedKVCache, ReqToTokenPool
from .memory import SWAKVCache


@dataclass
class TinyConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    max_context_len: int = 64
    sliding_window: Optional[int] = None
    swa_layers: Tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6


class RowLinear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on how many rows there are (on the CPU).

    CPU GEMM (MKL) picks kernels by the row count, so a row's result changes in the
    last bit between a raw batch and the same batch padded to a captured size; one
    matrix-vector product per row (a batched matmul) keeps eager and graph runs
    bit-identical. GPUs are compared with a tolerance and keep the plain GEMM.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2:
            return super().forward(x)
        w = self.weight.t().expand(x.shape[0], -1, -1)
        out = torch.bmm(x[:, None, :], w)[:, 0]
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE; the cos/sin table is indexed by ``positions`` on the device."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([angles.cos(), angles.sin()], -1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, heads, head_dim]``."""
        cos, sin = self.cos_sin_cache.index_select(0, positions)[:, None, :].chunk(2, dim=-1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: TinyConfig, layer_id: int, rotary: RotaryEmbedding, backend: TorchAttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = RowLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = RowLinear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.backend = backend  # shared, not a submodule

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary(positions, q.reshape(t, self.num_heads, self.head_dim))
        k = self.rotary(positions, k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.backend.forward(q, k, v, self.layer_id, fb))


class MLP(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.gate_up_proj = RowLinear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyConfig, layer_id: int, rotary: RotaryEmbedding, backend: TorchAttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), fb)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TinyLlama(nn.Module):
    def __init__(self, config: TinyConfig, backend: TorchAttentionBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = RowLinear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]``; ``fb.input_embeds`` replaces the embedding."""
        hidden = fb.input_embeds if fb.input_embeds is not None else self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, fb)
        return self.logits(hidden)


def _init_weights(model: TinyLlama, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Not all ones, so a norm that is skipped or misapplied shows in the logits.
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen))


@dataclass
class ReferenceRuntime:
    """What a graph runner needs from sglang's ``ModelRunner``, for the tiny model."""

    config: TinyConfig
    model: TinyLlama
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: PagedKVCache
    attn_backend: TorchAttentionBackend
    device: torch.device
    dtype: torch.dtype

    @property
    def kv_cache(self) -> PagedKVCache:
        return self.token_to_kv_pool

    @torch.no_grad()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Eager forward (any mode): fresh attention metadata, then the model."""
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)


def build_reference_model(
    config: Optional[TinyConfig] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    max_num_reqs: int = 32,
    kv_size: Optional[int] = None,
    swa_kv_size: Optional[int] = None,
) -> ReferenceRuntime:
    """Model, pools and backend. Pool sizes count the reserved index 0.

    With ``config.swa_layers`` the KV cache is an :class:`SWAKVCache` whose SWA slot
    space defaults to the full pool's size.
    """
    config = config or TinyConfig()
    device = torch.device(device)
    if config.swa_layers and not config.sliding_window:
        raise ValueError("swa_layers needs sliding_window")
    if config.head_dim % 2:
        raise ValueError("head_dim must be even for RoPE")
    kv_size = kv_size or max_num_reqs * config.max_context_len + 1
    req_pool = ReqToTokenPool(max_num_reqs + 1, config.max_context_len, device)
    kv_args = (config.num_layers, config.num_kv_heads, config.head_dim, kv_size)
    if config.swa_layers:
        kv: PagedKVCache = SWAKVCache(
            *kv_args, swa_size=swa_kv_size or kv_size, swa_layers=config.swa_layers, dtype=dtype, device=device
        )
    else:
        kv = PagedKVCache(*kv_args, dtype=dtype, device=device)
    backend = TorchAttentionBackend(
        req_pool,
        kv,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        sliding_window=config.sliding_window,
        swa_layers=config.swa_layers,
    )
    model = TinyLlama(config, backend)
    _init_weights(model, seed)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return ReferenceRuntime(config, model, req_pool, kv, backend, device, dtype)
