"""A pure-torch paged attention backend with sglang's CUDA-graph hooks.

Every query token gets a fixed-width row of ``max_context_len`` key slots (gathered from
``req_to_token``) and a boolean mask over it. That makes all shapes depend only on the
number of tokens, so the decode/verify path is graph-capturable: no ``.item()``, no
boolean indexing, no ``nonzero``, and no advanced ``tensor[index]`` (``aten.index`` is
tagged dynamic-output-shape); gathers go through ``index_select`` instead.

Metadata is computed outside the model (``init_forward_metadata`` eagerly, or the
capture/replay hooks into static buffers), and ``forward`` only reads
``self.forward_metadata``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .forward_batch import ForwardBatch, ForwardMode
from ..kvpool import PagedKVCache, ReqToTokenPool
from .memory import SWAKVCache


@dataclass
class TorchAttnMetadata:
    """Per-query-token view of the KV cache; every tensor has ``num_tokens`` rows."""

    kv_indices: torch.Tensor  # int64 [T, max_context_len], full-pool slot of key position c
    mask: torch.Tensor  # bool [T, max_context_len], causal: key position <= query position
    swa_kv_indices: Optional[torch.Tensor] = None  # same, in the SWA pool's slot space
    swa_mask: Optional[torch.Tensor] = None  # mask restricted to the last `window` positions


class TorchAttentionBackend:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_cache: PagedKVCache,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: Optional[int] = None,
        swa_layers=(),
    ):
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if swa_layers and not sliding_window:
            raise ValueError("swa_layers needs a sliding_window")
        self.req_to_token_pool = req_to_token_pool
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = 1.0 / math.sqrt(head_dim)
        self.sliding_window = sliding_window
        self.swa_layers = frozenset(int(layer) for layer in swa_layers)
        self.max_context_len = req_to_token_pool.max_context_len
        self.device = req_to_token_pool.device
        self.forward_metadata: Optional[TorchAttnMetadata] = None
        self.cuda_graph_metadata: Optional[TorchAttnMetadata] = None
        self._graph_tokens_per_bs: Dict[int, int] = {}

    # ------------------------------------------------------------------ metadata

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_layers

    @property
    def _has_swa(self) -> bool:
        return bool(self.swa_layers)

    @property
    def _separate_swa_pool(self) -> bool:
        return isinstance(self.kv_cache, SWAKVCache) and bool(self.kv_cache.swa_layers)

    def _build(self, req_pool_indices: torch.Tensor, token_req: torch.Tensor, q_pos: torch.Tensor) -> TorchAttnMetadata:
        """Metadata for query tokens at positions ``q_pos`` of requests ``token_req``.

        ``token_req`` indexes into ``req_pool_indices`` (row of the batch, not pool slot).
        """
        per_req = self.req_to_token_pool.req_to_token.index_select(0, req_pool_indices)
        kv_indices = per_req.index_select(0, token_req)
        key_pos = torch.arange(self.max_context_len, device=q_pos.device)
        mask = key_pos[None, :] <= q_pos[:, None]
        meta = TorchAttnMetadata(kv_indices=kv_indices, mask=mask)
        if self._has_swa:
            meta.swa_mask = mask & (key_pos[None, :] > q_pos[:, None] - self.sliding_window)
            if self._separate_swa_pool:
                mapping = self.kv_cache.full_to_swa_index_mapping
                meta.swa_kv_indices = mapping.index_select(0, kv_indices.reshape(-1)).view_as(kv_indices)
            else:
                meta.swa_kv_indices = kv_indices
        return meta

    def _build_decode(self, bs: int, req_pool_indices, seq_lens, forward_mode, tokens_per_bs: int) -> TorchAttnMetadata:
        req_pool_indices = req_pool_indices[:bs]
        seq_lens = seq_lens[:bs]
        num_tokens = bs * tokens_per_bs
        # sglang convention: verify seq_lens exclude the draft tokens, decode ones include.
        kv_lens = seq_lens + tokens_per_bs if forward_mode == ForwardMode.TARGET_VERIFY else seq_lens
        token_idx = torch.arange(num_tokens, device=seq_lens.device)
        token_req = token_idx // tokens_per_bs
        q_pos = kv_lens.index_select(0, token_req) - tokens_per_bs + token_idx % tokens_per_bs
        return self._build(req_pool_indices, token_req, q_pos)

    def _build_extend(self, fb: ForwardBatch) -> TorchAttnMetadata:
        # Eager only: host-side lengths decide the shapes.
        ext = list(fb.extend_seq_lens_cpu)
        seq = [int(s) for s in fb.seq_lens_cpu.tolist()]
        token_req: List[int] = []
        q_pos: List[int] = []
        for i, (n, s) in enumerate(zip(ext, seq)):
            token_req += [i] * n
            q_pos += range(s - n, s)
        dev = fb.seq_lens.device
        return self._build(
            fb.req_pool_indices,
            torch.tensor(token_req, dtype=torch.int64, device=dev),
            torch.tensor(q_pos, dtype=torch.int64, device=dev),
        )

    def init_forward_metadata_extend_padded(self, fb: Optional[ForwardBatch], num_tokens: int) -> None:
        """Extend metadata for ``fb``'s tokens padded to ``num_tokens`` rows, into the
        static buffers (prefill graph runners). ``fb`` None: every row is padding.

        Eager only (host-side lengths). Padded rows query request slot 0 at position 0,
        so they see only the dummy KV slot 0.
        """
        ext = list(fb.extend_seq_lens_cpu) if fb is not None else []
        seq = [int(s) for s in fb.seq_lens_cpu.tolist()] if fb is not None else []
        raw = sum(ext)
        if raw > num_tokens:
            raise ValueError(f"{raw} tokens do not fit {num_tokens} padded rows")
        token_req: List[int] = []
        q_pos: List[int] = []
        for i, (n, s) in enumerate(zip(ext, seq)):
            token_req += [i] * n
            q_pos += range(s - n, s)
        bs = len(ext)
        token_req += [bs] * (num_tokens - raw)  # the extra row below: request slot 0
        q_pos += [0] * (num_tokens - raw)
        dev = self.device
        rpi = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
        if bs:
            rpi[:bs] = fb.req_pool_indices[:bs]
        self._write_static(self._build(
            rpi,
            torch.tensor(token_req, dtype=torch.int64, device=dev),
            torch.tensor(q_pos, dtype=torch.int64, device=dev),
        ))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Eager path: fresh metadata tensors for ``fb``."""
        if fb.forward_mode == ForwardMode.EXTEND:
            self.forward_metadata = self._build_extend(fb)
        else:
            self.forward_metadata = self._build_decode(
                fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.forward_mode, fb.num_tokens_per_bs
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers, sliced per batch size, that captured graphs read from."""
        ctx = self.max_context_len
        dev = self.device
        meta = TorchAttnMetadata(
            kv_indices=torch.zeros(max_num_tokens, ctx, dtype=torch.int64, device=dev),
            mask=torch.zeros(max_num_tokens, ctx, dtype=torch.bool, device=dev),
        )
        if self._has_swa:
            meta.swa_kv_indices = torch.zeros(max_num_tokens, ctx, dtype=torch.int64, device=dev)
            meta.swa_mask = torch.zeros(max_num_tokens, ctx, dtype=torch.bool, device=dev)
        self.cuda_graph_metadata = meta
        self.cuda_graph_max_bs = max_bs
        self.cuda_graph_max_num_tokens = max_num_tokens

    def ensure_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """:meth:`init_cuda_graph_state` unless the static buffers already hold
        ``max_num_tokens`` rows: shared by a decode and a prefill runner, they grow, never
        shrink. Growing moves them, so graphs that read them (full-graph decode and
        prefill) are captured after it: build the runner with the most tokens first."""
        meta = self.cuda_graph_metadata
        if meta is None or meta.kv_indices.shape[0] < max_num_tokens:
            self.init_cuda_graph_state(max_bs, max_num_tokens)

    def _write_static(self, fresh: TorchAttnMetadata) -> None:
        static = self.cuda_graph_metadata
        if static is None:
            raise RuntimeError("call init_cuda_graph_state() before the cuda-graph hooks")
        n = fresh.kv_indices.shape[0]
        views = TorchAttnMetadata(kv_indices=static.kv_indices[:n], mask=static.mask[:n])
        views.kv_indices.copy_(fresh.kv_indices)
        views.mask.copy_(fresh.mask)
        if self._has_swa:
            views.swa_kv_indices = static.swa_kv_indices[:n]
            views.swa_mask = static.swa_mask[:n]
            views.swa_kv_indices.copy_(fresh.swa_kv_indices)
            views.swa_mask.copy_(fresh.swa_mask)
        self.forward_metadata = views

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        **_: object,
    ) -> None:
        tokens_per_bs = max(num_tokens // bs, 1) if bs else 1
        self._graph_tokens_per_bs[bs] = tokens_per_bs
        self._write_static(self._build_decode(bs, req_pool_indices, seq_lens, forward_mode, tokens_per_bs))

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: Optional[torch.Tensor] = None,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        num_tokens_per_bs: Optional[int] = None,
        **_: object,
    ) -> None:
        """Rewrite the static metadata in place for a (padded) batch of ``bs`` rows.

        ``num_tokens_per_bs`` defaults to what the graph of this ``bs`` was captured with.
        """
        tokens_per_bs = num_tokens_per_bs or self._graph_tokens_per_bs.get(bs)
        if tokens_per_bs is None:
            if forward_mode == ForwardMode.TARGET_VERIFY:
                raise ValueError(f"no graph captured for bs={bs}; pass num_tokens_per_bs")
            tokens_per_bs = 1
        self._write_static(self._build_decode(bs, req_pool_indices, seq_lens, forward_mode, tokens_per_bs))

    # ------------------------------------------------------------------- forward

    def _out_loc(self, fb: ForwardBatch, swa: bool) -> torch.Tensor:
        if not (swa and self._separate_swa_pool):
            return fb.out_cache_loc
        if fb.out_cache_loc_swa is not None:
            return fb.out_cache_loc_swa
        return self.kv_cache.swa_loc(fb.out_cache_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb: ForwardBatch,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q`` ``[T, H(*D)]``, ``k``/``v`` ``[T, Hkv(*D)]`` -> ``[T, H*D]``, written into
        ``out`` when given (a buffer a piecewise graph owns: no copy after the call).

        ``layer`` is a layer id or anything with a ``layer_id`` attribute.
        """
        layer_id = int(getattr(layer, "layer_id", layer))
        num_tokens = q.shape[0]
        hkv = self.num_kv_heads
        d = self.head_dim
        group = self.num_heads // hkv
        swa = self.is_swa_layer(layer_id)

        self.kv_cache.set_kv(layer_id, self._out_loc(fb, swa),
                             k.reshape(num_tokens, hkv, d), v.reshape(num_tokens, hkv, d))

        meta = self.forward_metadata
        kv_indices, mask = (meta.swa_kv_indices, meta.swa_mask) if swa else (meta.kv_indices, meta.mask)
        ctx = kv_indices.shape[1]
        flat = kv_indices.reshape(-1)
        keys = self.kv_cache.k_buffer[layer_id].index_select(0, flat).view(num_tokens, ctx, hkv, d).float()
        values = self.kv_cache.v_buffer[layer_id].index_select(0, flat).view(num_tokens, ctx, hkv, d).float()
        # Masked slots may hold anything a padded row wrote; 0 * inf would still poison.
        values = values.masked_fill(~mask[:, :, None, None], 0.0)

        qg = q.reshape(num_tokens, hkv, group, d).float()
        # Heads before context, materialised: on the strided layout CPU bmm picks another
        # kernel for one token than for several, so a raw run and its padded graph
        # would differ in the last bit.
        keys_hc = keys.transpose(1, 2).contiguous()
        scores = torch.einsum("thgd,thcd->thgc", qg, keys_hc) * self.scaling
        key_mask = mask[:, None, None, :]
        # A finite fill keeps a fully masked row (only possible in padded rows) NaN-free.
        scores = scores.masked_fill(~key_mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).masked_fill(~key_mask, 0.0)
        values_hc = values.transpose(1, 2).contiguous()  # as the keys: [T, Hkv, C, D]
        if out is not None and out.dtype == torch.float32 and out.is_contiguous():
            torch.matmul(probs, values_hc, out=out.view(num_tokens, hkv, group, d))  # straight into out
            return out
        result = torch.matmul(probs, values_hc).reshape(num_tokens, self.num_heads * d).to(q.dtype)
        return result if out is None else out.copy_(result)
