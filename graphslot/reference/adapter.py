"""The decode runner's adapter for the reference model (:mod:`graphslot.reference`), for
every capture mode: attention goes through
:class:`~graphslot.reference.graph_attention.GraphAttentionBackend`, installed here."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Mapping, Tuple

import torch

from ..runners.adapter import DecodeAdapter
from .forward_batch import ForwardBatch, ForwardMode
from .graph_attention import ATTENTION_OP, install_graph_attention
from .memory import SWAKVCache
from .model import ReferenceRuntime


class ReferenceDecodeAdapter(DecodeAdapter):
    #: The spec params :meth:`spec_params` sets: a decode spec declares them, a prefill spec does not.
    SPEC_PARAMS = ("seq_len_fill_value", "is_hybrid_swa")
    split_ops = (ATTENTION_OP,)

    def __init__(self, runtime: ReferenceRuntime):
        self.runtime = runtime
        self.device = runtime.device
        install_graph_attention(runtime.model)
        # The reference engine has no DP collectives; what capture asked for is kept
        # so callers (and tests) can see it.
        self.dp_buffer_lens: List[Tuple[List[int], int]] = []

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.runtime.model(fb.input_ids, fb.positions, fb)

    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        return self.runtime.forward(fb)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.runtime.attn_backend.ensure_cuda_graph_state(max_bs, max_num_tokens)

    def init_capture_metadata(self, bs: int, num_tokens: int, view: ForwardBatch) -> None:
        self.runtime.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, view.req_pool_indices, view.seq_lens, view.forward_mode
        )

    def init_replay_metadata(self, bs: int, view: ForwardBatch, raw_fb: ForwardBatch) -> None:
        self.runtime.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, view.req_pool_indices, view.seq_lens, view.seq_lens_cpu, view.forward_mode,
            num_tokens_per_bs=view.num_tokens_per_bs,
        )

    def make_dummy_batch(self, bs: int, num_tokens: int) -> ForwardBatch:
        k = max(num_tokens // bs, 1)
        dev = self.device

        def empty(device=dev):
            return torch.zeros(0, dtype=torch.int64, device=device)

        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if k == 1 else ForwardMode.TARGET_VERIFY,
            batch_size=0,
            input_ids=empty(),
            req_pool_indices=empty(),
            seq_lens=empty(),
            out_cache_loc=empty(),
            seq_lens_cpu=empty("cpu"),
            positions=empty(),
            num_token_non_padded=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            num_tokens_per_bs=k,
        )

    def spec_params(self) -> Mapping[str, Any]:
        kv = self.runtime.token_to_kv_pool
        return dict(zip(self.SPEC_PARAMS, (self.runtime.attn_backend.get_cuda_graph_seq_len_fill_value(),
                                           isinstance(kv, SWAKVCache) and bool(kv.swa_layers))))

    @property
    def max_requests(self) -> int:
        return self.runtime.req_to_token_pool.size - 1  # row 0 is the padding dummy

    def side_inputs(self) -> Mapping[str, Any]:
        rt = self.runtime
        return {"token_to_kv_pool": rt.token_to_kv_pool, "req_to_token_pool": rt.req_to_token_pool,
                "attn_backend": rt.attn_backend}

    def set_dp_buffer_len(self, global_num_tokens_cpu: List[int], global_dp_buffer_len: int) -> None:
        self.dp_buffer_lens.append((list(global_num_tokens_cpu), global_dp_buffer_len))

    def static_tensors(self) -> Iterable[torch.Tensor]:
        return (tensor for _, tensor in self.named_static_tensors())

    def named_static_tensors(self) -> Iterable[Tuple[str, torch.Tensor]]:
        rt = self.runtime
        kv = rt.token_to_kv_pool
        for name, t in rt.model.named_parameters():
            yield f"model.{name}", t
        for name, t in rt.model.named_buffers():
            yield f"model.{name}", t
        for kind in ("k_buffer", "v_buffer"):
            for layer, t in enumerate(getattr(kv, kind)):
                yield f"token_to_kv_pool.{kind}[{layer}]", t
        if isinstance(kv, SWAKVCache):
            yield "token_to_kv_pool.full_to_swa_index_mapping", kv.full_to_swa_index_mapping
        yield "req_to_token_pool.req_to_token", rt.req_to_token_pool.req_to_token
        meta = rt.attn_backend.cuda_graph_metadata
        if meta is not None:
            for f in dataclasses.fields(meta):
                t = getattr(meta, f.name)
                if isinstance(t, torch.Tensor):
                    yield f"attn_backend.cuda_graph_metadata.{f.name}", t
