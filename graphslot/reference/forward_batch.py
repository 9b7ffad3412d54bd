"""The per-step batch description handed to the model, named as in sglang.

Only the fields a CUDA-graph runner has to stage into static buffers are here. The
dataclass is plain on purpose: the slot registry makes shallow copies with
``copy.copy``/``dataclasses.replace`` and swaps tensors for static views, so building a
batch must not have side effects (no ``__post_init__``).

Conventions (as in sglang):

* DECODE: one new token per request; ``seq_lens`` counts it (the KV length after the
  step), ``positions = seq_lens - 1``.
* TARGET_VERIFY: ``num_tokens_per_bs`` draft tokens per request; ``seq_lens`` is the
  committed length *without* them, the KV length is ``seq_lens + num_tokens_per_bs``
  and ``positions = seq_lens + [0, 1, ..., k-1]``.
* EXTEND: requests of mixed lengths packed along tokens; ``seq_lens`` is prefix plus
  new tokens, ``extend_seq_lens_cpu`` the new tokens per request.
* Padded rows use request slot 0, ``seq_lens`` 1 and KV slot 0, all reserved as
  harmless dummies by :mod:`graphslot.kvpool`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional

import torch


class ForwardMode(enum.IntEnum):
    DECODE = enum.auto()
    EXTEND = enum.auto()
    TARGET_VERIFY = enum.auto()
    IDLE = enum.auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_cuda_graph(self) -> bool:
        """Modes whose shapes are static per batch size, i.e. graph-capturable."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs]
    out_cache_loc: torch.Tensor  # int64 [num_tokens]
    seq_lens_cpu: torch.Tensor  # int64 [bs], host copy of seq_lens
    positions: torch.Tensor  # int64 [num_tokens]
    mrope_positions: Optional[torch.Tensor] = None  # int64 [3, num_tokens]
    encoder_lens: Optional[torch.Tensor] = None
    out_cache_loc_swa: Optional[torch.Tensor] = None
    num_token_non_padded: Optional[torch.Tensor] = None  # int32 [1]
    global_num_tokens_gpu: Optional[torch.Tensor] = None
    global_num_tokens_for_logprob_gpu: Optional[torch.Tensor] = None
    global_num_tokens_cpu: Optional[List[int]] = None
    mamba_track_indices: Optional[torch.Tensor] = None
    mamba_track_mask: Optional[torch.Tensor] = None
    mamba_track_seqlens: Optional[torch.Tensor] = None
    input_embeds: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    num_tokens_per_bs: int = 1
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
