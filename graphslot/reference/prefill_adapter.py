"""The prefill runner's adapter for the reference model, for every capture mode.

The layer stack (``TinyLlama.layers`` run in order) is the capture boundary. Attention
is an eager break (``breakable``), the split op (``piecewise``) or inside the graph on
static metadata (``full``): the attention modules go through
:class:`~graphslot.reference.graph_attention.GraphAttentionBackend`, installed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..runners.prefill_adapter import PrefillAdapter
from .forward_batch import ForwardBatch, ForwardMode
from .graph_attention import ATTENTION_OP, install_graph_attention
from .memory import SWAKVCache
from .model import ReferenceRuntime


class ReferenceLayerStack(nn.Module):
    """``TinyLlama.layers`` run in order: ``(positions, hidden, fb) -> hidden``."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(positions, hidden, fb)
        return hidden


def is_decode(fb: Any) -> bool:
    """Whether ``fb`` carries a DECODE ``forward_mode`` (a batch type without one is not)."""
    mode = getattr(fb, "forward_mode", None)
    return mode is not None and mode.is_decode()


def as_extend(fb: ForwardBatch) -> ForwardBatch:
    """``fb`` as an EXTEND batch: itself, or a DECODE batch as one new token per request
    (its ``seq_lens`` already count the token, as an extend's do)."""
    if not is_decode(fb):
        return fb
    return dataclasses.replace(fb, forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=[1] * fb.batch_size)


class ReferencePrefillAdapter(PrefillAdapter):
    """``install_attention=False`` leaves the model's attention as it is (not graph-safe in
    any mode but ``full``: what the proxy is for). ``decode_batches=True``: a DECODE batch
    is a prefill too, of one new token per request after its cached prefix (what a
    :class:`~graphslot.runners.model_runner.ModelGraphRunner` needs for its piecewise
    graphs to serve the decode steps no full graph holds)."""

    split_ops = (ATTENTION_OP,)

    def __init__(self, runtime: ReferenceRuntime, *, install_attention: bool = True, decode_batches: bool = False):
        self.runtime = runtime
        self.device = runtime.device
        self.decode_batches = decode_batches
        if install_attention:
            install_graph_attention(runtime.model)

    @property
    def model(self) -> nn.Module:
        return self.runtime.model

    def layer_stack(self, model: nn.Module) -> nn.Module:
        return ReferenceLayerStack(model.layers)

    @property
    def hidden_size(self) -> int:
        return self.runtime.config.hidden_size

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.runtime.dtype

    def embed(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.input_embeds is not None:
            return fb.input_embeds
        return self.runtime.model.embed(fb.input_ids)

    def logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.runtime.model.logits(hidden)

    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        return self.runtime.forward(fb)

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.runtime.attn_backend.ensure_cuda_graph_state(max_bs, max_num_tokens)

    def init_capture_metadata(self, num_tokens: int, view: ForwardBatch) -> None:
        self.runtime.attn_backend.init_forward_metadata_extend_padded(None, num_tokens)

    def init_replay_metadata(self, num_tokens: int, view: ForwardBatch, raw_fb: ForwardBatch) -> None:
        self.runtime.attn_backend.init_forward_metadata_extend_padded(as_extend(raw_fb), num_tokens)

    def is_prefill(self, fb: ForwardBatch) -> bool:
        return (self.decode_batches and is_decode(fb)) or super().is_prefill(fb)

    def make_dummy_batch(self, num_tokens: int) -> ForwardBatch:
        dev = self.device

        def empty(device=dev):
            return torch.zeros(0, dtype=torch.int64, device=device)

        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=0, input_ids=empty(), req_pool_indices=empty(),
            seq_lens=empty(), out_cache_loc=empty(), seq_lens_cpu=empty("cpu"), positions=empty(),
            extend_seq_lens_cpu=[],
        )

    def spec_params(self) -> Mapping[str, Any]:
        kv = self.runtime.token_to_kv_pool
        return {"is_hybrid_swa": isinstance(kv, SWAKVCache) and bool(kv.swa_layers)}

    def side_inputs(self) -> Mapping[str, Any]:
        rt = self.runtime
        return {"token_to_kv_pool": rt.token_to_kv_pool, "req_to_token_pool": rt.req_to_token_pool,
                "attn_backend": rt.attn_backend}

    def static_tensors(self) -> Iterable[torch.Tensor]:
        rt = self.runtime
        kv = rt.token_to_kv_pool
        yield from rt.model.parameters()
        yield from rt.model.buffers()
        yield from kv.k_buffer
        yield from kv.v_buffer
        if isinstance(kv, SWAKVCache):
            yield kv.full_to_swa_index_mapping
        yield rt.req_to_token_pool.req_to_token
        meta = rt.attn_backend.cuda_graph_metadata
        if meta is not None:
            for f in dataclasses.fields(meta):
                t = getattr(meta, f.name)
                if isinstance(t, torch.Tensor):
                    yield t
