"""Allocating (or adopting) one slot's buffer, shared by both impls so both own bit-identical buffers; and
sharing buffers between registries (say decode and a draft model's decode), so capture and replay see one
address whichever runner filled it.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Dict, Iterable, Mapping, Protocol, Tuple, runtime_checkable

import torch

from ..spec.errors import SlotError, shorten
from .stepcheck import describe, overlaps


@runtime_checkable
class SharePool(Protocol):
    """A pool ``build_registry(buffers=...)`` accepts: given a fresh zero buffer, the tensor the slot is to use
    and whether it is *fresh* (then filled with ``init_value``). An engine may bring its own (sglang's)."""

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]: ...


class BufferPool:
    """Buffers keyed by ``(name, numel, dtype, device)``, held weakly: the first registrant is canonical, later
    ones view it to their shape. Registering is thread-safe; filling is not synchronised (one writer at a time)."""

    def __init__(self) -> None:
        self._buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._init: Dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]:
        """The canonical buffer viewed to ``tensor``'s shape, and whether ``tensor`` became it (to initialise)."""
        key = (name, tensor.numel(), tensor.dtype, tensor.device)
        init = 0 if init_value is None else init_value
        with self._lock:
            canonical = self._buffers.get(key)
            if canonical is None:
                self._buffers[key] = tensor
                self._init[key] = init
                return tensor, True
            first = self._init[key]
        if not same_value(first, init):
            shared = f"shared buffer ({tensor.numel()} x {tensor.dtype} on {tensor.device})"
            needs = f"was first registered with initial value {first!r}, this registry needs {init!r}"
            fix = "give both the same pad value, or build this registry with a pool of its own (or buffers=None)"
            raise SlotError(f"slot '{name}': {shared} {needs}; {fix}")
        return canonical.view(tensor.shape), False

    def __len__(self) -> int:
        return len(self._buffers)

    def __bool__(self) -> bool:
        return True  # an empty pool is still a pool (``share_pool=BufferPool()`` must share)


def same_value(a: Any, b: Any) -> bool:
    """Whether two pad values are the same: equal, or both NaN (which ``==`` never is)."""
    nans = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return nans or a == b


def strided(tensor: torch.Tensor) -> str:
    """``''`` when dense with a unit last stride, else its shape and strides: generated code views buffers of
    several dtypes as one integer dtype, which needs that (``is_contiguous()`` does not promise it for a last
    dimension of size 1)."""
    if tensor.is_contiguous() and not (tensor.dim() and tensor.stride(-1) != 1):
        return ""
    return f"shape {list(tensor.shape)}, strides {list(tensor.stride())}"


def refuse_strided(where: str, how: str, tensor: torch.Tensor) -> None:
    """SlotError unless dense with a unit last stride (:func:`strided`)."""
    layout = strided(tensor)
    if layout:
        fix = "pass a contiguous tensor (.contiguous() gives one)"
        raise SlotError(f"{where}: {how}= holds a non-contiguous tensor ({layout}); {fix}")


def allocate_buffer(
    name: str, shape: tuple, dtype: torch.dtype, device, init_value=None, pool=None, adopt=None, pin: bool = False
):
    """A full-capacity buffer, adopted from ``adopt`` or pooled when asked; filled with ``init_value`` when
    fresh (``pin``: in pinned host memory). What is adopted or pooled must have this shape, dtype and device. Its
    address never changes afterwards."""
    device = torch.device(device)
    if adopt is not None:
        return check_adopted(name, adopted_tensor(name, adopt), shape, dtype, device)  # initialised by its owner
    try:
        buffer = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    except (RuntimeError, MemoryError) as exc:  # out of memory: the type stays, the slot is named
        what = f"shape {list(shape)}, {dtype}, on {device}"
        exc.add_note(f"graphslot: while allocating the buffer of slot '{name}' ({what})")
        raise
    fresh = True
    if pool is not None:
        buffer, fresh = pooled(name, buffer, init_value, pool)
    if fresh and init_value is not None:
        buffer.fill_(init_value)
    return buffer


def check_adopted(name: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """``tensor`` if it can be slot ``name``'s buffer: dense, of its shape, dtype and device; else SlotError."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        want = f"{list(shape)} dtype {dtype}"
        got = f"{list(tensor.shape)} dtype {tensor.dtype}"
        raise SlotError(f"slot '{name}': cannot adopt the tensor: expected shape {want}, got shape {got}")
    if not _same_device(tensor.device, device):
        where = f"expected device {device}, got {tensor.device}"
        fix = f"pass a tensor on {device} (.to('{device}') gives one)"
        raise SlotError(f"slot '{name}': cannot adopt the tensor: {where}; {fix}")
    refuse_strided(f"slot '{name}'", "buffers", tensor)
    return tensor


def allocate_staged(name: str, shape: tuple, dtype: torch.dtype, device, init_value=None, pool=None, adopt=None):
    """A staged slot's ``(host, device)`` buffers: adopted (:func:`staged_tensors`), else allocated, the host one
    pinned when the device is CUDA (and pooled as ``'<name> (host)'``, never as the device one)."""
    device = torch.device(device)
    if adopt is not None:
        host, dev = staged_tensors(f"slot '{name}'", adopted_value(name, adopt), device)
        check_adopted(f"{name} (host)", host, shape, dtype, torch.device("cpu"))
        if dev is not host:
            check_adopted(name, dev, shape, dtype, device)
        return host, dev
    pin = device.type == "cuda" and torch.cuda.is_available()
    host = allocate_buffer(f"{name} (host)", shape, dtype, "cpu", init_value, pool, pin=pin)
    return host, allocate_buffer(name, shape, dtype, device, init_value, pool)


def slot_buffers(resolved: Any, given: Any, device: torch.device, pool: Any, adopt: Any) -> Tuple[Any, Any]:
    """One slot's ``(host, buffer)``: ``given`` (a bound buffer, or a staged slot's ``(host, device)`` pair), else
    allocated (on the CPU for ``device: cpu``), adopted or pooled as the slot asks. ``host`` is None but for a
    staged slot, ``buffer`` None for a disabled one."""
    buffer = given if resolved.enabled else None
    if resolved.enabled and buffer is None:
        where = "cpu" if resolved.host else device
        init = resolved.pad_value if resolved.fills_at_allocation else None
        adopted = adopt if resolved.adopt else None
        allocate = allocate_staged if resolved.staged else allocate_buffer
        buffer = allocate(resolved.name, resolved.shape, resolved.dtype, where, init, pool, adopted)
    if resolved.staged and isinstance(buffer, tuple):
        return buffer  # (host, device)
    return None, buffer


def staged_tensors(where: str, value: Any, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A staged slot's adoptee as its ``(host, device)`` tensors: an object with ``.cpu`` and ``.gpu`` tensors
    (vLLM's ``CpuGpuBuffer``) or a ``(host, device)`` pair. The host one must be on the CPU and the device one on
    ``device``; the same memory for both (a build whose device is the host) comes back as one tensor, twice.
    ``where`` (``slot 'x'``) starts the SlotError's message."""
    pair = (getattr(value, "cpu", None), getattr(value, "gpu", None))
    if not all(isinstance(t, torch.Tensor) for t in pair):
        pair = tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else (None, None)
    host, dev = pair
    if not (isinstance(host, torch.Tensor) and isinstance(dev, torch.Tensor)):
        what = "an object with .cpu and .gpu tensors (vLLM's CpuGpuBuffer) or a (host, device) pair of tensors"
        raise SlotError(f"{where} is staged: buffers= must hold {what} for it, got {type(value).__name__}")
    if host.device.type != "cpu":
        raise SlotError(f"{where} is staged: its host tensor must be on the CPU, got one on {host.device}")
    if not _same_device(dev.device, device):
        raise SlotError(f"{where} is staged: its device tensor must be on {device}, got one on {dev.device}")
    return host, (host if _same_view(host, dev) else dev)


def adopted_tensor(name: str, adopt: Any) -> torch.Tensor:
    """The tensor ``adopt`` holds for slot ``name`` (:func:`adopted_value`); a SlotError naming the slot when it
    is not a tensor."""
    tensor = adopted_value(name, adopt)
    if not isinstance(tensor, torch.Tensor):
        raise SlotError(f"slot '{name}': buffers= holds {type(tensor).__name__}, expected a torch.Tensor")
    return tensor


def adopted_value(name: str, adopt: Any) -> Any:
    """What ``adopt`` holds for slot ``name`` (an attribute, a mapping key or a dotted path of them); a
    SlotError naming the slot when there is nothing, or when looking it up raises."""
    tensor = adopt
    try:
        for part in name.split("."):
            tensor = tensor.get(part) if isinstance(tensor, Mapping) else getattr(tensor, part, None)
            if tensor is None:
                break
    except Exception as exc:  # an engine object's own __getattr__ or property
        raised = f"{type(exc).__name__}: {shorten(exc, quote=False)}"
        fix = f"give buffers= a tensor '{name}', or declare the slot `adopt: never`"
        raise SlotError(f"slot '{name}': looking up its tensor in buffers= raised {raised}; {fix}") from exc
    if tensor is None:
        fix = "give it one, or declare the slot `adopt: never`"
        raise SlotError(f"slot '{name}': buffers= has no tensor '{name}' to adopt; {fix}")
    return tensor


def pooled(name: str, buffer: torch.Tensor, init_value: Any, pool: SharePool) -> Tuple[torch.Tensor, bool]:
    """``pool.share``'s tensor for slot ``name`` and whether it is fresh; SlotError naming the pool and the slot
    unless it has ``buffer``'s shape, dtype and device."""
    try:
        shared = pool.share(name, buffer, init_value)
    except SlotError:
        raise
    except Exception as exc:
        exc.add_note(f"graphslot: while sharing the buffer of slot '{name}' through the pool {type(pool).__name__}")
        raise
    tensor = shared[0] if isinstance(shared, tuple) and len(shared) == 2 else None
    if not isinstance(tensor, torch.Tensor):
        got = f"{describe(shared)}, expected (tensor, fresh)"
    elif not fits(tensor, buffer.shape, buffer.dtype, buffer.device):
        expected = layout(buffer.shape, buffer.dtype, buffer.device)
        got = f"{layout(tensor.shape, tensor.dtype, tensor.device)}, expected {expected}"
    elif strided(tensor):
        fix = "a pool's share() must return a contiguous tensor (.contiguous() gives one)"
        raise SlotError(
            f"slot '{name}': the pool {type(pool).__name__} returned a non-contiguous tensor ({strided(tensor)}); {fix}"
        )
    else:
        return tensor, shared[1]
    fix = "a pool's share() must return a tensor of the shape, dtype and device it was given"
    raise SlotError(f"slot '{name}': the pool {type(pool).__name__} returned {got}; {fix}")


#: What to do when two slots' buffers share memory, by where the buffers came from.
OWN_MEMORY = {
    "adopted": "give each slot in buffers= a tensor of its own (views of one allocation must not overlap)",
    "pool": "a pool must return a tensor of its own for each slot name"
    " (gs.BufferPool shares by (name, numel, dtype, device), so only across registries)",
    "bound": "bind a tensor of its own to each slot",
}


def owned_buffers(slots: Iterable[Any]) -> Dict[str, torch.Tensor]:
    """The enabled ``slots``' buffers by the names :func:`refuse_shared_memory` reports, in spec order: a staged
    slot's two are two, ``'<name> (host)'`` and ``'<name>'`` (one tensor for both: one)."""
    owned: Dict[str, torch.Tensor] = {}
    for slot in slots:
        if len(slot.buffers()) == 2:
            owned[f"{slot.name} (host)"] = slot.host
        owned[slot.name] = slot.buffer
    return owned


def refuse_shared_memory(spec_name: str, buffers: Mapping[str, torch.Tensor], pool: Any, adopt: Any) -> None:
    """SlotError naming two slots whose buffers share memory (device and byte ranges, as strict mode judges a
    source's aliasing): within one registry every slot has memory of its own. A pool shares across registries."""
    order = {name: index for index, name in enumerate(buffers)}
    pairs = [(sorted(found[:2], key=order.get), found[2]) for found in overlaps(buffers.items())]
    if not pairs:
        return
    names, nbytes = min(pairs, key=lambda pair: (order[pair[0][1]], order[pair[0][0]]))  # the first in spec order
    first, second = names
    a = buffers[first]
    b = buffers[second]
    if adopt is not None:
        kind = "adopted"
        origin = "buffers= adopted"
    elif pool is not None:
        kind = "pool"
        origin = f"from the pool {type(pool).__name__}"
    else:
        kind = "bound"
        origin = "bound"
    if _same_view(a, b):
        what = f"slots '{first}' and '{second}' were given the same tensor ({origin})"
    else:
        what = f"the buffers of slots '{first}' and '{second}' overlap ({nbytes} bytes on {a.device}, {origin})"
    raise SlotError(f"spec '{spec_name}': {what}; every slot of a registry needs memory of its own: {OWN_MEMORY[kind]}")


def fits(tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    return tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype and _same_device(tensor.device, device)


def layout(shape: tuple, dtype: torch.dtype, device: torch.device) -> str:
    return f"shape {list(shape)} {dtype} on {device}"


def check_given_buffers(spec_name: str, slots, buffers: Any, device: torch.device) -> Dict[str, Any]:
    """``build(bind=...)``: a tensor of the resolved shape, dtype and device for every enabled slot (a staged one:
    its two, as :func:`staged_tensors` takes them), bound as it is; SlotError naming the first that does not fit."""
    if not isinstance(buffers, Mapping):
        raise SlotError(f"spec '{spec_name}': buffers= must map slot names to tensors, got {type(buffers).__name__}")
    given = {}
    for slot in slots:
        if not slot.enabled:
            continue
        value = buffers.get(slot.name)
        at = f"spec '{spec_name}', slot '{slot.name}'"
        if slot.staged and value is not None:
            host, dev = staged_tensors(at, value, device)  # one tensor for both: the same one twice
            given[slot.name] = (_bound(f"{at} (host)", host, slot, torch.device("cpu")), _bound(at, dev, slot, device))
        else:
            given[slot.name] = _bound(at, value, slot, torch.device("cpu") if slot.host else device)
    return given


def _bound(at: str, tensor: Any, slot, where: torch.device) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise SlotError(f"{at}: buffers= has {'no tensor' if tensor is None else type(tensor).__name__} for it")
    if not fits(tensor, slot.shape, slot.dtype, where):
        got = layout(tensor.shape, tensor.dtype, tensor.device)
        raise SlotError(f"{at}: buffers= holds {got}, expected {list(slot.shape)} {slot.dtype} on {where}")
    refuse_strided(at, "bind", tensor)
    return tensor


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor's memory seen alike: the same device, address, shape, strides, dtype."""
    same_address = a.device == b.device and a.data_ptr() == b.data_ptr()
    return same_address and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
