"""The attention of a transformers model, routed so every capture mode can cut at it.

:func:`route_attention` points a model's ``config._attn_implementation`` at a
graphslot function registered with transformers' ``AttentionInterface``
(``"graphslot_sdpa"`` or ``"graphslot_eager"``: the model's own implementation
inside). The attention modules then call :func:`graphslot_attention`, which picks by
how it is being run:

* plain (eager forwards, ``capture="full"``): the model's attention, as before;
* inside a breakable capture: the same call through a function marked
  :func:`~graphslot.runners.breakable.eager_on_graph`, so the capture cuts there and
  the attention runs eagerly between segments (outside a breakable capture the mark is
  a plain call, so this is also the plain route);
* while Dynamo traces (``capture="piecewise"``): the custom ops
  ``graphslot_hf::attention`` and ``graphslot_hf::prefill_attention`` (fake impls give
  the output shape), the split ops of :data:`SPLIT_OPS`; outside ``torch.compile`` they
  are never called.

Two phases. Decode (and any forward over a ``Cache``): the cache has written and
gathered K and V already and the mask comes with the call; the routed part is the
attention itself. Prefill (:mod:`.prefill`): the layer stack runs without a cache and
passes ``graphslot_prefill=<PrefillMetadata>``; the routed part writes the new tokens'
K and V into the paged pool and attends over the keys the metadata names
(:meth:`.prefill.PrefillMetadata.keys_and_mask`), all inside the graph under
``capture="full"``, eagerly (on the live batch's metadata) otherwise.

Non-tensor arguments reach the ops as integer handles (:func:`handle`): the attention
module (what the model's implementation reads: ``num_key_value_groups``,
``training``) and the prefill metadata.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from ...runners.breakable import eager_on_graph
from ...runners.handles import op_handle, op_object
from .cache import _gather

#: The implementations a model can be routed over, and the name each is registered as.
ROUTED = {"sdpa": "graphslot_sdpa", "eager": "graphslot_eager"}
#: Families whose attention modules call ``ALL_ATTENTION_FUNCTIONS`` and whose decoder
#: layers run as Llama's (tests/test_hf_runners.py: Llama in every phase x capture mode,
#: the others in a full prefill graph and a breakable decode graph).
ROUTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: The split ops of a piecewise capture (decode, prefill).
SPLIT_OPS = ("graphslot_hf::attention", "graphslot_hf::prefill_attention")

def inner_implementation(config: Any) -> Optional[str]:
    """``"sdpa"`` or ``"eager"`` of a routed config (or of one not routed), else None."""
    impl = getattr(config, "_attn_implementation", None)
    return next((k for k, v in ROUTED.items() if v == impl), impl if impl in ROUTED else None)


def route_attention(model: Any) -> None:
    """Route ``model``'s attention through :func:`graphslot_attention` (idempotent).
    Its results are the model's own in every eager forward. Only the attention modules
    see the routed implementation (each gets a copy of its config naming it):
    ``model.config`` is left as the engine set it, so the model still serves any other
    user of it (transformers' own continuous batching checks that name)."""
    inner = inner_implementation(model.config)
    if inner is None:
        raise ValueError(f"{type(model).__name__} uses attn_implementation "
                         f"{model.config._attn_implementation!r}; graphslot routes {' or '.join(ROUTED)}")
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups"):
            op_handle(m)
            if m.config is model.config:
                m.config = copy.copy(model.config)
            m.config._attn_implementation = ROUTED[inner]


def _model_attention(module: Any):
    """The model's own attention function for ``module`` (sdpa, or its file's eager one)."""
    if inner_implementation(module.config) == "sdpa":
        return sdpa_attention_forward
    return sys.modules[type(module).__module__].eager_attention_forward


def attend(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           scaling: Optional[float]) -> torch.Tensor:
    """The model's attention over given keys: ``[B, T, heads, width]``."""
    return _model_attention(module)(module, q, k, v, mask, scaling=scaling, dropout=0.0)[0]


def prefill_attend(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any,
                   scaling: Optional[float]) -> torch.Tensor:
    """A prefill layer's attention: the new tokens' K and V to the pool, then attention
    over the keys ``meta`` names (``q``, ``k``, ``v``: ``[1, heads, tokens, width]``)."""
    layer = module.layer_idx
    t = k.shape[2]
    pool = meta.cache.pool
    pool.set_kv(layer, meta.loc, k[0].transpose(0, 1).reshape(t, k.shape[1], -1),
                v[0].transpose(0, 1).reshape(t, v.shape[1], -1))
    slots, mask = meta.keys_and_mask(layer, q.dtype)
    keys = _gather(pool.k_buffer[layer], slots).transpose(0, 1).unsqueeze(0)
    values = _gather(pool.v_buffer[layer], slots).transpose(0, 1).unsqueeze(0)
    return attend(module, q, keys, values, mask, scaling)


# -- breakable: the same calls, marked ---------------------------------------------------
eager_attend = eager_on_graph(attend)
eager_prefill_attend = eager_on_graph(prefill_attend)


# -- piecewise: the same calls, as custom ops --------------------------------------------
@torch.library.custom_op(SPLIT_OPS[0], mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                 scaling: float, module: int) -> torch.Tensor:
    return attend(op_object(module), q, k, v, mask, scaling)


@attention_op.register_fake
def _attention_fake(q, k, v, mask, scaling, module):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))


@torch.library.custom_op(SPLIT_OPS[1], mutates_args=("k_cache", "v_cache"))
def prefill_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, scaling: float, module: int, meta: int) -> torch.Tensor:
    return prefill_attend(op_object(module), q, k, v, op_object(meta), scaling)


@prefill_attention_op.register_fake
def _prefill_attention_fake(q, k, v, k_cache, v_cache, scaling, module, meta):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))


def graphslot_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                        dropout: float = 0.0, graphslot_prefill: Any = None, **kwargs: Any):
    """What a routed model's attention modules call (``AttentionInterface``'s signature)."""
    if scaling is None:
        scaling = float(query.shape[-1]) ** -0.5
    compiling = torch.compiler.is_compiling()
    # Under compile the handles op_handle set are read as attributes, which dynamo takes as constants.
    if graphslot_prefill is None:
        if compiling:
            out = attention_op(query, key, value, attention_mask, scaling, module._graphslot_handle)
        else:
            out = eager_attend(module, query, key, value, attention_mask, scaling)
    elif compiling:
        pool = graphslot_prefill.cache.pool
        out = prefill_attention_op(query, key, value, pool.k_buffer[module.layer_idx],
                                   pool.v_buffer[module.layer_idx], scaling, module._graphslot_handle,
                                   graphslot_prefill._graphslot_handle)
    else:
        out = eager_prefill_attend(module, query, key, value, graphslot_prefill, scaling)
    return out, None


for _inner, _name in ROUTED.items():
    AttentionInterface.register(_name, graphslot_attention)
    # The masks transformers builds for a routed model are its implementation's.
    AttentionMaskInterface.register(_name, ALL_MASK_ATTENTION_FUNCTIONS[_inner])
