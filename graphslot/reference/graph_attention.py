"""The reference attention as every capture mode needs it, in both phases.

The reference model's attention modules call the backend through
:class:`GraphAttentionBackend` (:func:`install_graph_attention`), a thin proxy that makes
the attention

* an eager break for ``capture="breakable"``: :func:`reference_attention` is marked
  :func:`~graphslot.runners.breakable.eager_on_graph`, so it runs eagerly between
  segments (decode metadata from static buffers; prefill extend metadata, which depends
  on per-request lengths);
* a split op for ``capture="piecewise"``: while ``torch.compile`` traces, the proxy
  allocates the attention's output and calls the opaque custom op
  ``graphslot_ref::attention`` (:data:`ATTENTION_OP`) to write into it, which the
  compiled function is split at. The output is allocated in the piece before the op, so
  it is a buffer that piece's graph owns: at replay the eager attention writes the result
  where the next piece reads it, with no copy (an op that returns a fresh tensor is
  copied into the tensor it returned at capture, at every replay);
* capturable for ``capture="full"``: outside a breakable capture and a trace it is a
  plain call of the backend, which reads the metadata the hooks wrote into its static
  buffers (decode; prefill through ``init_forward_metadata_extend_padded``).

Eager runs are plain calls too, so installing the proxy changes no result.

The op takes tensors only: the layer's K/V cache tensors and the output buffer (declared
mutated: the op writes the new tokens' K/V and the result into them), the batch's KV slot
indices and the layer id; the attention backend itself is not a tensor, so the op finds
it through an integer handle (:func:`~graphslot.runners.handles.op_handle`). The metadata
is read from the backend when the op runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..runners.breakable import eager_on_graph
from ..runners.handles import op_handle, op_object
from .attention import TorchAttentionBackend
from .forward_batch import ForwardBatch
from .model import Attention

#: The split-op name the piecewise capture mode is told about (the adapters' ``split_ops``).
ATTENTION_OP = "graphslot_ref::attention"

class _OutLoc:
    """The two batch fields the backend's forward reads."""

    __slots__ = ("out_cache_loc", "out_cache_loc_swa")

    def __init__(self, out_cache_loc: torch.Tensor, out_cache_loc_swa: Optional[torch.Tensor]):
        self.out_cache_loc = out_cache_loc
        self.out_cache_loc_swa = out_cache_loc_swa


@torch.library.custom_op(ATTENTION_OP, mutates_args=("k_cache", "v_cache", "out"))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, out_cache_loc: torch.Tensor, out_cache_loc_swa: Optional[torch.Tensor],
              out: torch.Tensor, layer_id: int, handle: int) -> None:
    op_object(handle).forward(q, k, v, layer_id, _OutLoc(out_cache_loc, out_cache_loc_swa), out=out)


@attention.register_fake
def _attention_fake(q, k, v, k_cache, v_cache, out_cache_loc, out_cache_loc_swa, out, layer_id, handle):
    return None


@eager_on_graph
def reference_attention(backend: TorchAttentionBackend, q, k, v, layer_id: int, fb: ForwardBatch):
    return backend.forward(q, k, v, layer_id, fb)


class GraphAttentionBackend:
    """Delegates to the real backend: through :data:`ATTENTION_OP` while ``torch.compile``
    traces, else through :func:`reference_attention` (an eager break in a breakable capture)."""

    def __init__(self, inner: TorchAttentionBackend):
        self.inner = inner
        self.handle = op_handle(inner)

    def forward(self, q, k, v, layer, fb):
        layer_id = int(getattr(layer, "layer_id", layer))
        if torch.compiler.is_compiling():
            kv = self.inner.kv_cache
            out = q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))  # in the piece before: the graph's own
            torch.ops.graphslot_ref.attention(
                q, k, v, kv.k_buffer[layer_id], kv.v_buffer[layer_id], fb.out_cache_loc,
                getattr(fb, "out_cache_loc_swa", None), out, layer_id, self.handle)
            return out
        return reference_attention(self.inner, q, k, v, layer_id, fb)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def install_graph_attention(model: nn.Module) -> int:
    """Route every reference attention module through :class:`GraphAttentionBackend`
    (idempotent); the number of attention modules."""
    count = 0
    for m in model.modules():
        if isinstance(m, Attention):
            if not isinstance(m.backend, GraphAttentionBackend):
                m.backend = GraphAttentionBackend(m.backend)
            count += 1
    return count
