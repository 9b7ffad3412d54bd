"""What the tape knows of an ATen op: its kind (what replay does with it), its check, and
the record of one call, its tensors pinned to the memory they had (:class:`Pins`); and
the walks over the tensors of op arguments.

Kinds: ``alloc`` (no kernel: nothing to replay), ``scalar`` (0-dim host data, a
constant of the graph), ``view`` (aliases, no kernel), ``mutate`` (writes an input:
re-run as is), ``compute`` (a result in new memory: re-run, copied into the tensor it
made at capture), ``collective`` (re-issued over the process group and waited for).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.utils import _python_dispatch

from .checks import HOST_DATA_OPS, OpCheck, op_check

# Allocation only: on a GPU these launch no kernel, so there is nothing to replay.
_ALLOC_OPS = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
    "aten.new_empty.default", "aten.new_empty_strided.default",
})
# Collectives: functional collectives (torch.distributed._functional_collectives and the
# ops under it) and c10d's own ops (torch.distributed's Python API). Replay re-issues each
# one and waits for it at once; every rank replays the same graph, so they match up.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})
# Waits have nothing left to do at replay: the collective waited when it ran.
_WAIT_OPS = frozenset({"_c10d_functional.wait_tensor.default", "c10d_functional.wait_tensor.default"})


@dataclass(frozen=True)
class OpInfo:
    kind: str  # "alloc" | "scalar" | "view" | "mutate" | "compute" | "collective"
    check: Optional[OpCheck]
    out_kwargs: frozenset  # write-only out= arguments: not inputs of the graph


@functools.lru_cache(maxsize=None)
def op_info(func: torch._ops.OpOverload) -> OpInfo:
    name = str(func)
    tags = set(func.tags)
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if name in _ALLOC_OPS:
        kind = "alloc"
    elif name in _WAIT_OPS:
        kind = "view"  # returns its argument; replay waited when it re-issued the collective
    elif func.namespace in _COLLECTIVE_NAMESPACES:
        kind = "collective"
    elif name in HOST_DATA_OPS:
        kind = "scalar"  # only 0-dim host data gets past the check
    elif torch.Tag.inplace_view in tags:
        kind = "view"  # squeeze_, t_, as_strided_ ...: metadata only, no kernel
    elif writes:
        kind = "mutate"
    elif func.is_view or any(r.alias_info is not None for r in schema.returns):
        kind = "view"
    else:
        kind = "compute"
    out_kwargs = frozenset(a.name for a in schema.arguments if getattr(a, "is_out", False))
    return OpInfo(kind, op_check(name, tags), out_kwargs)


@dataclass
class Record:
    """One op as captured: its tensors as :class:`Pins` aliases."""

    func: torch._ops.OpOverload
    info: OpInfo
    args: tuple
    kwargs: dict
    out: Any
    value: Optional[torch.Tensor] = None  # a host scalar's value at capture


class Pins:
    """Aliases of the tensors a capture's ops touch, each pinned to what an op saw: the
    storage, size, stride and offset the tensor had right after the op ran.

    A CUDA graph reads the addresses it was captured with. A tensor rebound later
    (``p.data = new``, what weight loaders do) has new storage that the graph never reads,
    while in-place writes into the old storage (``p.copy_(new)``) it does read. Replay runs
    on these aliases, so the same holds on the tape whether an op got the tensor itself
    (the Parameter of an embedding) or a view of it (``weight.t()`` in ``F.linear``); and
    an in-place view op later in the capture (``squeeze_`` inside ``F.linear`` on 1-D
    input) changes the tensor object, not what the earlier op read. One alias per tensor
    and metadata, made at record time: replay does no extra work.
    """

    def __init__(self) -> None:
        # (id, metadata, storage) -> (tensor, alias); the tensor is kept so its id stays its own
        self._aliases: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def swapped(self, x: Any, metas: list) -> Any:
        """``x`` (op arguments or results) with each tensor replaced by its alias;
        ``metas``: ``(tensor, metadata)`` of each, right after the op."""
        new = {}
        for t, seen in metas:
            key = (id(t), seen, storage(t))
            if key not in self._aliases:
                with torch.no_grad():
                    self._aliases[key] = (t, t.as_strided(*seen))
            new[id(t)] = self._aliases[key][1]
        return swap(x, new)

    def given(self) -> dict[int, torch.Tensor]:
        """id of an alias -> the tensor the op got."""
        return {id(alias): t for t, alias in self._aliases.values()}


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """Tensor leaves of op args: ATen nests at most Tensor[] inside the arg tuple."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)


def swap(x: Any, new: dict[int, torch.Tensor]) -> Any:
    """``x`` with every tensor whose ``id`` is in ``new`` replaced."""
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, (tuple, list)):
        return type(x)(swap(y, new) for y in x)
    if isinstance(x, dict):
        return {k: swap(v, new) for k, v in x.items()}
    return x


def meta(t: torch.Tensor) -> tuple:
    return (t.size(), t.stride(), t.storage_offset())


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def unrecordable(args: Any) -> Optional[str]:
    """Why the tape cannot record an op on these tensors (arguments and results), or None."""
    for t in tensors(args):
        if t.is_nested:
            return "it touches a nested tensor"
        if t.layout is not torch.strided:
            return f"it touches a {str(t.layout).removeprefix('torch.')} tensor"
        if _python_dispatch.is_traceable_wrapper_subclass(t):
            return f"it touches a tensor subclass ({type(t).__name__})"
    return None
