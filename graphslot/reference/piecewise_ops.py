"""The reference attention as a custom op, for the piecewise prefill runner.

The piecewise runner compiles the layer stack with ``torch.compile`` and splits the
FX graph at declared *split ops*. For Dynamo not to trace into the attention (whose
extend metadata depends on per-request lengths), the reference attention is the
opaque custom op ``graphslot_ref::attention``; a fake impl gives Dynamo its output
shape. The op takes tensors only: the layer's K/V cache tensors (declared mutated:
the op writes the new tokens' K/V into them), the batch's KV slot indices and the
layer id; the attention backend itself is not a tensor, so the op finds it through an
integer handle (:func:`register_backend`). The attention metadata is read from the
backend when the op runs (eagerly, between pieces), as in the eager forward.

:func:`install_attention_ops` routes every reference attention module through the op
(:class:`CustomOpAttentionBackend`, a thin proxy). Outside ``torch.compile`` the op is
a plain call of the backend, so installing it changes nothing for eager runs.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import torch
from torch import nn

from .attention import TorchAttentionBackend
from .model import Attention
from .prefill_adapter import BreakingAttentionBackend, ReferencePrefillAdapter

#: The split-op name the piecewise runner is told about (``split_ops=(...)``).
ATTENTION_OP = "graphslot_ref::attention"

_BACKENDS: Dict[int, TorchAttentionBackend] = {}
_NEXT = itertools.count(1)


def register_backend(backend: TorchAttentionBackend) -> int:
    """An integer handle the op uses to find ``backend`` (registered once)."""
    for handle, b in _BACKENDS.items():
        if b is backend:
            return handle
    handle = next(_NEXT)
    _BACKENDS[handle] = backend
    return handle


class _OutLoc:
    """The two batch fields the backend's forward reads."""

    __slots__ = ("out_cache_loc", "out_cache_loc_swa")

    def __init__(self, out_cache_loc: torch.Tensor, out_cache_loc_swa: Optional[torch.Tensor]):
        self.out_cache_loc = out_cache_loc
        self.out_cache_loc_swa = out_cache_loc_swa


@torch.library.custom_op(ATTENTION_OP, mutates_args=("k_cache", "v_cache"))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, out_cache_loc: torch.Tensor, out_cache_loc_swa: Optional[torch.Tensor],
              layer_id: int, handle: int) -> torch.Tensor:
    backend = _BACKENDS[handle]
    out = backend.forward(q, k, v, layer_id, _OutLoc(out_cache_loc, out_cache_loc_swa))
    # A custom op may not return an alias of an input.
    return out.clone() if out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() else out


@attention.register_fake
def _attention_fake(q, k, v, k_cache, v_cache, out_cache_loc, out_cache_loc_swa, layer_id, handle):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class CustomOpAttentionBackend:
    """Delegates to the real backend through ``torch.ops.graphslot_ref.attention``."""

    def __init__(self, inner: TorchAttentionBackend):
        self.inner = inner
        self.handle = register_backend(inner)

    def forward(self, q, k, v, layer, fb):
        layer_id = int(getattr(layer, "layer_id", layer))
        kv = self.inner.kv_cache
        return torch.ops.graphslot_ref.attention(
            q, k, v, kv.k_buffer[layer_id], kv.v_buffer[layer_id], fb.out_cache_loc,
            getattr(fb, "out_cache_loc_swa", None), layer_id, self.handle)


def install_attention_ops(model: nn.Module) -> int:
    """Route every reference attention module through the custom op (idempotent);
    a :class:`~graphslot.reference.prefill_adapter.BreakingAttentionBackend` is unwrapped."""
    count = 0
    for m in model.modules():
        if isinstance(m, Attention):
            backend: Any = m.backend
            if not isinstance(backend, CustomOpAttentionBackend):
                if isinstance(backend, BreakingAttentionBackend):
                    backend = backend.inner
                m.backend = CustomOpAttentionBackend(backend)
            count += 1
    return count


class PiecewiseReferencePrefillAdapter(ReferencePrefillAdapter):
    """The reference prefill adapter with attention as the split op instead of an
    ``eager_on_graph`` break."""

    split_ops = (ATTENTION_OP,)

    def __init__(self, runtime, *, install_ops: bool = True):
        super().__init__(runtime, install_breaks=False)
        if install_ops:
            install_attention_ops(runtime.model)
