"""Which of the gathered positions each query of a :class:`~.cache.PagedCache` step sees.

The cache gathers the first ``L`` positions of each row's context (``L``: the gather
length, :meth:`~.cache.PagedCache.gathering`); the mask says which of them a query
sees: position ``j`` is visible to a query at position ``p`` when ``j <= p`` (and
``j > p - window`` on a sliding-window layer, as transformers' own sliding mask).
Unused and stale positions are masked out; their values are finite (the pool starts
at zero, a freed slot keeps what it held), so they add nothing.

Two mask routes. Most families take the additive 4-D mask as given (``"4d"``). Bloom
and alibi Falcon build their alibi bias from a 2-D padding mask, so for them
(``"2d"``, :func:`.families.mask_route`) the mask is ``[B, L]`` (1 where ``j <= `` the
row's last query position) and transformers builds causal-and-padding itself from the
query offset the cache reports (:meth:`AttentionMasks.query_offset`): 0 for a forward
of several tokens per row (a prefill whose rows start at position 0 in column 0,
right-padded: checked), ``L - 1`` for a decode step, where the 2-D mask alone says what
each row sees. Alibi from that mask is ``slope * j``, a key-position bias, which
softmax makes the same as ``slope * (j - i)``.

Every mask is computed on the device from the step's positions, so a graph captures it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .families import mask_route

#: Mask routes (see the module docstring).
MASK_4D = "4d"
MASK_2D = "2d"

#: A mask: one tensor when every layer has the same kind, else a mapping by layer type.
Mask = Union[torch.Tensor, Dict[str, torch.Tensor]]


class AttentionMasks:
    """The masks for the layers ``layer_kinds`` (``(layer type, window or None)`` per
    layer) of a model of ``config``, over at most ``max_context_len`` gathered positions."""

    def __init__(self, config: Any, layer_kinds: Sequence[Tuple[str, Optional[int]]], max_context_len: int,
                 device: torch.device):
        self.layer_kinds = layer_kinds
        #: ``"4d"`` (an additive mask the model takes as given) or ``"2d"`` (see the module docstring).
        self.route = mask_route(config)
        if self.route == MASK_2D and any(window for _, window in layer_kinds):
            raise ValueError(f"{type(config).__name__}: sliding-window layers cannot take the 2-D mask its "
                             "family needs (the window is a 4-D mask's business)")
        #: ``[1, 1, max_context_len]`` positions of the gathered keys, made once (a static input).
        self.kv_positions = torch.arange(max_context_len, device=device).view(1, 1, -1)
        self._query_len = 1  # tokens per row of the forward whose mask was made last (2-D route)

    def attention_mask(self, positions: torch.Tensor, length: int, dtype: torch.dtype) -> Mask:
        """The mask for queries at ``positions`` (``[B, T]``) over the first ``length``
        gathered positions: route ``"4d"``, additive masks ``[B, 1, T, length]``; route
        ``"2d"``, ``[B, length]`` of 0/1 (a forward of several tokens per row must have
        each row's token at position ``p > 0`` in column ``p``, else ValueError)."""
        kv = self.kv_positions if length == self.kv_positions.shape[-1] else self.kv_positions[..., :length]
        if self.route == MASK_2D:
            return self._two_d(positions, kv)
        return self._additive(positions.unsqueeze(-1), kv, None, dtype)

    def packed_mask(self, query_seqs: torch.Tensor, query_positions: torch.Tensor, key_seqs: torch.Tensor,
                    key_positions: torch.Tensor, dtype: torch.dtype) -> Mask:
        """The mask of a packed step, ``[1, 1, T, K]``: query ``i`` of sequence
        ``query_seqs[i]`` at ``query_positions[i]`` sees key ``j`` when it is of the same
        sequence at a position ``<=`` its own (and within the window on a sliding layer)."""
        same = query_seqs.view(1, -1, 1) == key_seqs.view(1, 1, -1)
        return self._additive(query_positions.view(1, -1, 1), key_positions.view(1, 1, -1), same, dtype)

    def query_offset(self, length: int) -> int:
        """Where the queries start among ``length`` gathered positions, for transformers' mask
        from a 2-D mask: 0 for a forward of several tokens per row, ``length - 1`` for one."""
        return 0 if self._query_len > 1 else length - 1

    def _additive(self, pos: torch.Tensor, kv: torch.Tensor, same: Optional[torch.Tensor], dtype: torch.dtype
                  ) -> Mask:
        """Additive masks ``[B, 1, T, L]``: 0 where the key at ``kv`` is visible from the
        query at ``pos`` (``[B, T, 1]``), the dtype's lowest elsewhere; per layer type."""
        visible = kv <= pos if same is None else (kv <= pos) & same
        masks: Dict[str, torch.Tensor] = {}
        for kind, window in dict.fromkeys(self.layer_kinds):
            seen = visible if window is None else visible & (kv > pos - window)
            masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
                ~seen, torch.finfo(dtype).min).unsqueeze(1)
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _two_d(self, positions: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self._query_len = positions.shape[-1]
        if self._query_len > 1:  # eager only (a prefill): a decode step has one token per row
            columns = torch.arange(self._query_len, device=positions.device)
            if not bool(((positions == columns) | (positions == 0)).all()):
                raise ValueError("PagedCache (2-D mask route): a forward of several tokens per row needs each row's "
                                 "token at position p in column p (rows start at position 0 in column 0, padded on "
                                 "the right): the query offset that transformers combines with a 2-D mask is one int "
                                 "for the whole batch")
        last = positions.max(dim=-1, keepdim=True).values  # [B, 1]: the row's last query position
        return (kv.view(1, -1) <= last).to(torch.int64)
