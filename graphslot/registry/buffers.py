"""Allocating (or adopting) one slot's buffer. Shared by the interpreter and by
generated ``allocate`` functions, so both own bit-identical buffers."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from ..spec.errors import SlotError
from .pool import SharePool
from ..spec.resolve import ResolvedSlot

_MISSING = object()


def adoptable(adopt: Any, name: str) -> Any:
    """The tensor ``adopt`` holds for slot ``name`` (attribute, mapping key or dotted
    path), or ``_MISSING``."""
    value = adopt
    for part in name.split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        else:
            value = getattr(value, part, _MISSING)
        if value is _MISSING or value is None:
            return _MISSING
    return value


def refuse_strided(where: str, how: str, tensor: torch.Tensor) -> None:
    """SlotError for a tensor a registry would bind or adopt that is not dense with a
    unit last stride: generated code views buffers of several dtypes as one integer dtype
    (one copy kernel a step), which needs that layout (``is_contiguous()`` alone does not
    promise the unit stride of a last dimension of size 1)."""
    if not tensor.is_contiguous() or (tensor.dim() and tensor.stride(-1) != 1):
        raise SlotError(
            f"{where}: {how}= holds a non-contiguous tensor (shape {list(tensor.shape)}, strides "
            f"{list(tensor.stride())}); pass a contiguous tensor (.contiguous() gives one)"
        )


def allocate_buffer(
    name: str,
    shape: Tuple[int, ...],
    dtype: torch.dtype,
    device: Union[str, torch.device],
    init_value: Any = None,
    pool: Optional[SharePool] = None,
    adopt: Any = None,
) -> torch.Tensor:
    """A full-capacity buffer, adopted from ``adopt`` (``build_registry(buffers=<object>)``) or
    pooled when asked; filled with ``init_value`` when it is fresh. Its address never
    changes afterwards."""
    if adopt is not None:
        tensor = adoptable(adopt, name)
        if tensor is _MISSING:
            raise SlotError(
                f"slot '{name}': buffers= has no tensor '{name}' to adopt; "
                "give it one, or declare the slot `adopt: never`"
            )
        if not isinstance(tensor, torch.Tensor):
            raise SlotError(f"slot '{name}': buffers= holds {type(tensor).__name__}, expected a torch.Tensor")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise SlotError(
                f"slot '{name}': cannot adopt the tensor: expected shape "
                f"{list(shape)} dtype {dtype}, got shape {list(tensor.shape)} "
                f"dtype {tensor.dtype}"
            )
        refuse_strided(f"slot '{name}'", "buffers", tensor)
        return tensor  # adopted tensors are already initialised by their owner
    try:
        buffer = torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:  # out of memory: the type stays, the slot is named
        exc.add_note(
            f"graphslot: while allocating the buffer of slot '{name}' (shape {list(shape)}, {dtype}, on {device})"
        )
        raise
    fresh = True
    if pool is not None:
        buffer, fresh = pool.share(name, buffer, init_value)
    if fresh and init_value is not None:
        buffer.fill_(init_value)
    return buffer


def allocate_slot_buffer(slot: ResolvedSlot, device: torch.device, pool=None, adopt=None) -> torch.Tensor:
    return allocate_buffer(
        slot.name,
        slot.shape,
        slot.dtype,
        "cpu" if slot.host else device,
        slot.pad_value if slot.fills_at_allocation else None,
        pool,
        adopt if slot.adopt else None,
    )


def check_given_buffers(spec_name: str, slots, buffers: Any, device: torch.device) -> Dict[str, torch.Tensor]:
    """``build_registry(buffers=...)``: a tensor of the resolved shape, dtype and device
    for every enabled slot, bound as it is (nothing allocated, pooled or adopted);
    SlotError naming the first slot that does not fit."""
    if not isinstance(buffers, Mapping):
        raise SlotError(f"spec '{spec_name}': buffers= must map slot names to tensors, got {type(buffers).__name__}")
    given = {}
    for slot in slots:
        if not slot.enabled:
            continue
        tensor = buffers.get(slot.name)
        where = torch.device("cpu") if slot.host else device
        if not isinstance(tensor, torch.Tensor):
            raise SlotError(
                f"spec '{spec_name}', slot '{slot.name}': buffers= has "
                f"{'no tensor' if tensor is None else type(tensor).__name__} for it"
            )
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype or not _same_device(tensor.device, where):
            raise SlotError(
                f"spec '{spec_name}', slot '{slot.name}': buffers= holds shape {list(tensor.shape)} "
                f"{tensor.dtype} on {tensor.device}, expected {list(slot.shape)} {slot.dtype} on {where}"
            )
        refuse_strided(f"spec '{spec_name}', slot '{slot.name}'", "bind", tensor)
        given[slot.name] = tensor
    return given


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
