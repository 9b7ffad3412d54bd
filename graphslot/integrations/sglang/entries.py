"""A ``GraphSlot`` registered from Python, as a graphslot spec entry.

``slot_entry`` turns the slot's fields (this package's ``GraphSlot`` or sglang's own,
read by duck typing) into the plain data of one ``slots:`` item and its hooks:
``shape_fn`` was evaluated at registration and its extents are written as literals,
the sliced one as ``max_bs`` / ``max_num_tokens``; ``slice_fn`` becomes ``slice_dim``
(probed on the buffer, unless it is a :class:`~.slots.SliceDim`); the callables
(``post_fill``, ``source_fn``) become hooks under names made from the slot's name
(``sglang.post_fill.<slot>``; a dotted slot sglang never copies gets :func:`no_source`), so
the spec, and the generated module compiled for it, do not depend on which closures a
registry holds. ``check_entry`` validates the entry through ``graphslot.spec_from_dict``
(errors are ``SpecError``, a ``ValueError``, naming the slot).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Tuple

import torch

from ...spec.errors import shorten
from ...spec.loading import spec_from_dict
from ...spec.yaml_loader import INT_LIMIT
from .slots import AXES, RESETTING, SliceDim, policy_name

#: Every spec the drop-in builds treats an absent batch field as sglang does.
ABSENT_FIELDS = "skip"
CODE_LABEL = "<graphslot.integrations.sglang: register_slot>"
CAPACITY_NAMES = {"bs": "max_bs", "tokens": "max_num_tokens"}


def dtype_name(dtype: Any, slot: str) -> str:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"GraphSlot {slot!r}: dtype must be a torch.dtype, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _extent(value: Any) -> Any:
    """``value`` as an int when torch takes it as an extent (an int, numpy integer or
    integer tensor, not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def buffer_shape(slot: str, shape: Any) -> Tuple[int, ...]:
    """``shape_fn``'s result as extents: a tuple (``torch.Size``) or list of ints, or one
    int (a 1-d shape), as sglang's ``torch.zeros(shape)`` takes them. TypeError for what
    is not such a shape, ValueError for an extent not in ``[1, 2**63)``, naming the slot."""
    one = _extent(shape)
    if one is None and not isinstance(shape, (tuple, list)):
        raise TypeError(f"GraphSlot {slot!r}: shape_fn returned {shorten(shape)}: a shape is a tuple of ints "
                        "(or one int)")
    extents = (shape,) if one is not None else tuple(shape)
    ints = tuple(_extent(n) for n in extents)
    if None in ints:
        bad = extents[ints.index(None)]
        raise TypeError(f"GraphSlot {slot!r}: shape_fn returned {shorten(shape)}: extents must be ints, got "
                        f"{shorten(bad)} ({type(bad).__name__})")
    if any(n <= 0 for n in ints):
        raise ValueError(f"GraphSlot {slot!r}: shape_fn returned {shorten(shape)}: extents must be positive")
    if any(n >= INT_LIMIT for n in ints):
        raise ValueError(f"GraphSlot {slot!r}: shape_fn returned {shorten(shape)}: extents must be below 2**63")
    return ints


def _number(value: Any, slot: str) -> Any:
    if isinstance(value, (bool, int, float)):
        return value
    item = getattr(value, "item", None)  # a one-element tensor or numpy scalar
    if callable(item):
        try:
            return _number(item(), slot)
        except (RuntimeError, ValueError):
            pass
    raise ValueError(f"GraphSlot {slot!r}: pad_value must be a number, got {value!r}")


def _same_view(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def slice_dim(slot: Any, buffer: torch.Tensor, capacity: int) -> int:
    """The dimension ``slot.slice_fn`` slices to the first ``n`` entries (0 without
    one); ValueError for a ``slice_fn`` that is not such a slice."""
    fn = slot.slice_fn
    axis = slot.axis
    if fn is None:
        return 0
    if isinstance(fn, SliceDim):
        if not 0 <= fn.dim < max(buffer.dim(), 1):
            raise ValueError(f"GraphSlot {slot.name!r}: {fn!r} on a {buffer.dim()}-d buffer")
        return fn.dim
    if axis == "none":  # sglang calls it with the whole first extent: it must give the buffer
        n = buffer.shape[0] if buffer.dim() else 1
        if _probe(fn, buffer, n, buffer):
            return 0
        raise ValueError(f"GraphSlot {slot.name!r}: axis 'none' never slices, but slice_fn(buffer, {n}) is not "
                         "the whole buffer; drop the slice_fn")
    probes = sorted({0, 1, capacity // 2, capacity - 1, capacity} & set(range(capacity + 1)))
    matches = [d for d, extent in enumerate(buffer.shape) if extent == capacity
               and all(_probe(fn, buffer, n, buffer.narrow(d, 0, n)) for n in probes)]
    if len(matches) != 1:
        raise ValueError(f"GraphSlot {slot.name!r}: slice_fn is not the first n entries of one dimension of "
                         f"extent {capacity} (like buf[:, :n]); graphslot needs that dimension: pass "
                         "slice_fn=SliceDim(dim)")
    return matches[0]


def _probe(fn: Callable, buffer: torch.Tensor, n: int, expected: torch.Tensor) -> bool:
    try:
        return _same_view(fn(buffer, n), expected)
    except Exception:  # a slice_fn that cannot take this n is not a plain slice
        return False


def slot_entry(slot: Any, buffer: torch.Tensor, max_bs: int, max_num_tokens: int,
               device: torch.device) -> Tuple[Dict[str, Any], Dict[str, Callable]]:
    """``(entry, hooks)`` for an enabled slot whose buffer is ``buffer``; ValueError
    for what a graphslot spec cannot say (the message says what to change)."""
    name = slot.name
    axis = slot.axis
    if not isinstance(name, str) or axis not in AXES:
        raise ValueError(f"GraphSlot {name!r}: name must be a str and axis one of {', '.join(AXES)}, got {axis!r}")
    policy = policy_name(slot.padding_policy)
    entry: Dict[str, Any] = {"name": name, "shape": [int(n) for n in buffer.shape],
                             "dtype": dtype_name(slot.dtype, name), "axis": axis}
    if axis != "none":
        capacity = max_bs if axis == "bs" else max_num_tokens
        if buffer.dim() == 0:
            raise ValueError(f"GraphSlot {name!r}: a 0-d buffer cannot be sliced by axis {axis!r}; use axis 'none'")
        d = slice_dim(slot, buffer, capacity)
        if buffer.shape[d] != capacity:
            raise ValueError(f"GraphSlot {name!r}: axis {axis!r} slices dimension {d} of shape "
                             f"{tuple(buffer.shape)}, whose extent must be {CAPACITY_NAMES[axis]}={capacity}")
        entry["shape"][d] = CAPACITY_NAMES[axis]
        if d:
            entry["slice_dim"] = d
        if (slot.slice_fn is not None and not isinstance(slot.slice_fn, SliceDim) and policy in RESETTING
                and d != buffer.dim() - 1):
            raise ValueError(f"GraphSlot {name!r}: sglang resets a slice_fn slot's tail along its last "
                             f"dimension, but slice_fn slices dimension {d}; pass slice_fn=SliceDim({d})")
    else:
        slice_dim(slot, buffer, 1)
        d = 0
    entry.update(_padding(slot, policy, axis))
    _where(slot, device, entry)
    hooks: Dict[str, Callable] = {}
    copy = bool(slot.copy_from_fb)
    if slot.post_fill is not None:
        hooks[_hook(entry, "post_fill")] = slot.post_fill
    if slot.source_fn is not None and copy:
        if d:
            raise ValueError(f"GraphSlot {name!r}: sglang copies a source_fn result along dimension 0, but the "
                             f"slot slices dimension {d}")
        hooks[_hook(entry, "source")] = slot.source_fn
    elif "." in name:  # sglang never copies it (it reads fb.<'a.b'>, never there): its source gives None
        hooks[_hook(entry, "source")] = no_source
        copy = True  # a spec's dotted slot is copied from its source (copy_from_fb: false is refused)
    if not copy:
        entry["copy_from_fb"] = False
    return entry, hooks


def no_source(fb: Any, ctx: Any) -> None:
    """The ``source`` of a dotted slot sglang never copies (no ``source_fn``, or
    ``copy_from_fb=False``): a spec's dotted slot needs one, and None is no copy."""
    return None


def _padding(slot: Any, policy: str, axis: str) -> Dict[str, Any]:
    pad = None if slot.pad_value is None else _number(slot.pad_value, slot.name)
    if axis == "none":  # never reset; an init value makes it fill_once
        return {"padding": "fill_once", "pad_value": pad} if policy in ("fill_sentinel", "fill_once") \
            and pad is not None else {}
    if policy == "fill_sentinel" and pad is None:
        raise ValueError(f"GraphSlot {slot.name!r}: FILL_SENTINEL requires pad_value")
    if policy == "fill_once" and pad is None:
        return {"padding": "keep_pad"}  # sglang: no init fill, no reset
    return {"padding": policy, "pad_value": pad} if policy in ("fill_sentinel", "fill_once") else {"padding": policy}


def _where(slot: Any, device: torch.device, entry: Dict[str, Any]) -> None:
    if slot.device is None:
        return
    where = torch.device(slot.device)
    if where.type == "cpu":
        entry["device"] = "cpu"
    elif where.type != device.type or (where.index is not None and device.index is not None
                                       and where.index != device.index):
        raise ValueError(f"GraphSlot {slot.name!r}: device {where} is neither the registry's ({device}) nor "
                         "'cpu'")


def _hook(entry: Dict[str, Any], kind: str) -> str:
    ref = entry[kind] = f"sglang.{kind}.{entry['name']}"
    return ref


def check_entry(entry: Dict[str, Any]) -> None:
    """Validate one entry as graphslot validates a spec file (cached by its data)."""
    spec_from_dict({"name": "sglang", "absent_fields": ABSENT_FIELDS, "slots": [entry]}, label=CODE_LABEL)
