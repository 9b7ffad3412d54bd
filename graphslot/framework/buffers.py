"""Allocating (or adopting) one slot's buffer. Shared by the interpreter and by
generated ``allocate`` functions, so both own bit-identical buffers."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .errors import SlotError
from .pool import BufferPool
from .resolve import ResolvedSlot

_MISSING = object()


def adoptable(source: Any, name: str) -> Any:
    """The tensor ``source`` holds for slot ``name`` (attribute, mapping key or dotted
    path), or ``_MISSING``."""
    value = source
    for part in name.split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        else:
            value = getattr(value, part, _MISSING)
        if value is _MISSING or value is None:
            return _MISSING
    return value


def allocate_slot_buffer(
    slot: ResolvedSlot,
    device: torch.device,
    pool: Optional[BufferPool] = None,
    source: Any = None,
) -> torch.Tensor:
    """The slot's full-capacity buffer; its address never changes afterwards."""
    where = torch.device("cpu") if slot.host else device
    if source is not None:
        tensor = adoptable(source, slot.name)
        if tensor is _MISSING:
            raise SlotError(f"slot '{slot.name}': source= has no tensor '{slot.name}' to adopt; "
                            "give it one, or build the registry without source=")
        if not isinstance(tensor, torch.Tensor):
            raise SlotError(f"slot '{slot.name}': source= holds {type(tensor).__name__}, expected a torch.Tensor")
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise SlotError(f"slot '{slot.name}': cannot adopt source tensor: expected shape "
                            f"{list(slot.shape)} dtype {slot.dtype}, got shape {list(tensor.shape)} "
                            f"dtype {tensor.dtype}")
        return tensor  # adopted tensors are already initialised by their owner
    buffer = torch.zeros(slot.shape, dtype=slot.dtype, device=where)
    fresh = True
    if pool is not None:
        buffer, fresh = pool.share(slot.name, buffer)
    if fresh and slot.fills_at_allocation:
        buffer.fill_(slot.pad_value)
    return buffer
