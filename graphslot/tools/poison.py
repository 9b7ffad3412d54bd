"""Poisoned padded tails: the two values ``graphslot verify`` writes into a tail that
its slot's padding policy leaves untouched.

``keep_pad``, ``foreach_copy`` and ``fill_once`` promise nothing about the tail but that
it holds what some earlier step (or the allocation) left there. So both patterns are
values such a tail can really hold, or worse:

* ``stale``: the step's own real rows repeated over the tail (row ``j`` of the tail gets
  real row ``j % raw``), as if a larger earlier step had left its rows there;
* ``hostile``: per dtype, floats ``NaN``; bools the stale pattern flipped; integers, at
  every element, the next value after the stale one among the values the slot has
  carried (the real rows of every step verified so far and the allocation value), so
  the two patterns differ wherever there is more than one value to choose from, and an
  integer tail never holds an id no real step wrote (an embedding or gather reading it
  stays in range, as the policy's contract says; a GPU kernel indexing out of range
  would kill the process, not report).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..spec.kinds import Padding

#: The policies that leave the padded tail as it is (slot_specs/README.md, "Padding policies").
UNTOUCHED_POLICIES = tuple(p.value for p in Padding if not p.writes_tail)
PATTERNS = ("stale", "hostile")
#: Distinct integer values remembered per slot.
MAX_DOMAIN = 4096


def poisonable(slot) -> bool:
    """A slot whose padded tail no step resets."""
    return slot.resolved.axis.sliced and not slot.resolved.padding.writes_tail


def hostile_name(dtype: torch.dtype) -> str:
    if dtype.is_floating_point or dtype.is_complex:
        return "nan"
    return "flipped" if dtype == torch.bool else "other seen values"


class Poisoner:
    """Writes one pattern into one slot's tail; remembers the integer values it saw."""

    def __init__(self) -> None:
        self.domain: Dict[str, torch.Tensor] = {}

    def observe(self, slot, raw: int) -> None:
        """Add the real rows of ``slot`` (just filled) to its domain."""
        buf = slot.buffer
        if buf.dtype.is_floating_point or buf.dtype.is_complex or buf.dtype == torch.bool:
            return
        init = 0 if slot.resolved.pad_value is None else slot.resolved.pad_value
        values = [buf.narrow(slot.resolved.slice_dim, 0, raw).flatten(), buf.new_full((1,), init)]
        known = self.domain.get(slot.name)
        if known is not None:
            values.append(known)
        self.domain[slot.name] = torch.unique(torch.cat(values))[:MAX_DOMAIN]

    def write(self, slot, raw: int, padded: int, pattern: str) -> Optional[str]:
        """Poison rows ``[raw:padded]`` of ``slot``; None, or why nothing was written."""
        if padded <= raw:
            return "no padded rows"
        dim = slot.resolved.slice_dim
        buf = slot.buffer
        rows = torch.arange(padded - raw, device=buf.device) % raw
        stale = buf.narrow(dim, 0, raw).index_select(dim, rows)
        if pattern == "stale":
            value = stale
        elif buf.dtype.is_floating_point or buf.dtype.is_complex:
            value = torch.full_like(stale, float("nan"))
        elif buf.dtype == torch.bool:
            value = ~stale
        else:
            domain = self.domain[slot.name]
            nxt = torch.searchsorted(domain, stale.contiguous(), right=True) % domain.numel()
            value = domain[nxt]
        buf.narrow(dim, raw, padded - raw).copy_(value)
        return None
