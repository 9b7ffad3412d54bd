"""What graphslot knows of particular transformers families, in one place.

* :data:`REFUSED`: families that would run through :class:`~.cache.PagedCache` and
  decode silently wrong, refused whatever ``allow_untested`` says, with the reason;
* :func:`mask_route`: the families that take a 2-D padding mask instead of the 4-D one
  (they build an alibi bias from it); :func:`packs`: those that can run a packed step;
* :func:`capture_shims`: a capturable stand-in for a method a family's forward would
  otherwise run a host-to-device copy in (a tensor made from a Python list), applied
  to one model's modules for the duration of a graph capture only;
* :func:`family_problem`: the rest of what makes a model of a family impossible to serve.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

_ROBERTA_POSITIONS = ("it derives its positions from the input ids, offset by padding_idx + 1; graphslot passes "
                      "each token's position from 0, so every row would differ from the model's own decode")

#: model_type -> why a model of that family is refused even with ``allow_untested=True``.
REFUSED: Dict[str, str] = {
    "gpt_neo": ("its local-attention layers build their band from the gathered key length, assuming the keys are "
                "positions 0..n-1 with the query last (modeling_gpt_neo: bias[:, :, key_len - q_len:key_len]); the "
                "paged cache gathers a fixed length per row, so the band would be wrong and decode silently wrong"),
    **{family: _ROBERTA_POSITIONS for family in ("roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
                                                 "camembert", "data2vec-text", "xmod")},
}


#: Families that look each position up in a table of ``config.max_position_embeddings``
#: rows (learnt, or sinusoids computed once): a position past it is an IndexError in the
#: forward (GPT-2's ``wpe``, OPT's and BioGPT's ``embed_positions``, GPT-J's sinusoids...;
#: XGLM grows its table from the cache's length, which a paged cache does not report).
#: Rope and alibi families compute any position.
POSITION_TABLES = ("gpt2", "gpt_bigcode", "gptj", "opt", "biogpt", "xglm", "ctrl")


def mask_route(config: Any) -> str:
    """``"2d"`` for the families that build alibi from a 2-D padding mask (Bloom, Falcon with
    ``alibi=True``), ``"4d"`` for the rest (see :mod:`.masks`)."""
    family = getattr(config, "model_type", None)
    if family == "bloom" or (family == "falcon" and getattr(config, "alibi", False)):
        return "2d"
    return "4d"


def packs(config: Any) -> bool:
    """Whether a model of this family can run a packed step (:func:`.batches.packed_logits`:
    several sequences in one row, each attending over its own context among all the
    gathered keys). Not the 2-D mask route (its alibi needs one row per sequence), nor MPT
    (its alibi table covers ``max_seq_len`` keys; a packed step gathers every sequence's)."""
    return mask_route(config) == "4d" and getattr(config, "model_type", None) != "mpt"


def _falcon_split_heads(self: Any, fused_qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``FalconAttention._split_heads`` for the multi-query and the new decoder architecture,
    where transformers indexes one column with a Python list (``[-2]``, which makes a
    tensor on the host and copies it to the device inside the forward): the same views
    through slices. The multi-head variant takes transformers' own code."""
    batch, seq, _ = fused_qkv.shape
    if self.new_decoder_architecture:
        groups = fused_qkv.view(batch, seq, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        query = groups[:, :, :, :-2]
        key = groups[:, :, :, -2:-1].expand(query.shape)
        value = groups[:, :, :, -1:].expand(query.shape)
        return query.flatten(2, 3), key.flatten(2, 3), value.flatten(2, 3)
    if self.multi_query:
        heads = fused_qkv.view(batch, seq, self.num_heads + 2, self.head_dim)
        return heads[..., :-2, :], heads[..., -2:-1, :], heads[..., -1:, :]
    return type(self)._split_heads(self, fused_qkv)


#: model_type -> (module class name, method, capturable stand-in) applied by capture_shims.
SHIMS: Dict[str, List[Tuple[str, str, Callable]]] = {
    "falcon": [("FalconAttention", "_split_heads", _falcon_split_heads)],
}


@contextlib.contextmanager
def capture_shims(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s modules of a shimmed class run the stand-ins
    (:data:`SHIMS`), bound on those module instances only: transformers' classes, other
    models and every forward outside the block run transformers' own code."""
    shims = SHIMS.get(getattr(model.config, "model_type", None), ())
    patched: List[Tuple[Any, str]] = []
    try:
        for module in (model.modules() if shims else ()):
            for class_name, method, stand_in in shims:
                if type(module).__name__ == class_name and method not in vars(module):
                    setattr(module, method, types.MethodType(stand_in, module))
                    patched.append((module, method))
        yield
    finally:
        for module, method in patched:
            delattr(module, method)


def family_problem(model: Any, max_context_len: Optional[int] = None) -> Optional[str]:
    """Why graphslot cannot serve ``model`` (its family, its settings), or None."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family in REFUSED:
        return f"model_type {family!r} is not supported: {REFUSED[family]}"
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if getattr(config, "_experts_implementation", None) == "eager" and can_set is not None and can_set():
        return ("experts_implementation='eager' cannot be captured: its loop over experts reads the routing on the "
                "host (one_hot checks indices with .item(), nonzero has a data-dependent shape); call "
                "model.set_experts_implementation('grouped_mm') (transformers' default) or 'batched_mm' first")
    positions = getattr(config, "max_position_embeddings", None)
    if family in POSITION_TABLES and max_context_len is not None and positions and max_context_len > positions:
        return (f"max_context_len={max_context_len} is more than the model's {positions} positions "
                f"(config.max_position_embeddings={positions}): its position table ends there, so a longer request "
                f"would fail in the forward; pass max_context_len <= {positions}")
    max_seq_len = getattr(config, "max_seq_len", None)
    if family == "mpt" and max_context_len is not None and max_seq_len is not None and max_context_len > max_seq_len:
        return (f"MPT slices its alibi bias to the key length, at most config.max_seq_len={max_seq_len}; "
                f"max_context_len={max_context_len} is longer")
    return None
