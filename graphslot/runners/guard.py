"""The replay guard: a debug check that nothing a graph reads has moved since capture.

A captured graph holds raw addresses. Rebinding a slot buffer, reallocating a KV pool
or a weight (``param.data = ...``, ``pool.k_buffer[0] = torch.empty(...)``), or
resizing a tensor leaves the graph reading the old memory: silent wrong answers on a
GPU. Before each replay the guard re-reads every slot buffer and every tensor the
adapter declares static and compares its data pointer, shape, dtype and strides with what they
were at capture; a difference raises :class:`ReplayGuardError` naming the tensor,
logged first at WARNING (``graphslot.runners.guard``).

The snapshot is taken again whenever the runner captures with no graph left from
before: at construction (or the first lazy capture), at ``recapture()`` (after a weight
reload, say) and at the first capture after ``release()``. A lazy capture beside graphs
captured earlier keeps it: those graphs still read what it holds.

On with ``GRAPHSLOT_DEBUG=1`` or ``DecodeRunnerConfig(guard=True)``; it costs one
``data_ptr()`` and two comparisons per tensor per replay (``benchmarks/bench_guard.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import torch

from .. import env
from ..log import get_logger
from .contract import named_statics

log = get_logger(__name__)

GUARD_ENV = env.DEBUG.name

Named = Tuple[str, torch.Tensor]


class ReplayGuardError(RuntimeError):
    """A tensor a captured graph reads moved, changed shape or dtype since capture."""


def guard_wanted(flag: Optional[bool]) -> bool:
    """The runner's ``guard`` setting; None defers to ``GRAPHSLOT_DEBUG``."""
    if flag is not None:
        return bool(flag)
    return env.DEBUG.enabled()


def runner_tensors(registry: Any, adapter: Any) -> Iterator[Named]:
    """Every slot buffer and declared static tensor (the models' weights included), read
    afresh (a rebinding shows)."""
    for slot in registry.active:
        yield f"slot '{slot.name}'", slot.buffer
    for name, tensor in named_statics(adapter):
        yield f"static tensor '{name}'", tensor


Signature = Tuple[int, torch.Size, torch.dtype, Tuple[int, ...]]


def _signature(t: torch.Tensor) -> Signature:
    return t.data_ptr(), t.shape, t.dtype, t.stride()


def _describe(sig: Signature, strides: bool = False) -> str:
    ptr, shape, dtype, stride = sig
    layout = f" strides {list(stride)}" if strides else ""
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}{layout} at 0x{ptr:x}"


class ReplayGuard:
    """Snapshot at construction and at each :meth:`refresh` (right after capture);
    :meth:`check` before each replay."""

    def __init__(self, tensors: Callable[[], Iterable[Named]]):
        self._tensors = tensors
        self._names: List[str] = []
        self._expected: List[Signature] = []
        self.refresh()

    def refresh(self) -> None:
        """Take the snapshot again: what graphs captured from now on read."""
        named = list(self._tensors())
        self._names = [name for name, _ in named]
        self._expected = [_signature(t) for _, t in named]

    def check(self) -> None:
        seen = [(name, _signature(t)) for name, t in self._tensors()]
        if len(seen) != len(self._expected) or any(
                sig != want for (_, sig), want in zip(seen, self._expected)):
            message = self._explain(seen)
            log.warning("%s", message)
            raise ReplayGuardError(message)

    def _explain(self, seen: List[Tuple[str, Any]]) -> str:
        fix = ("the captured graph still reads the old memory: write into the tensor in place "
               "(copy_, fill_), never rebind, reallocate, resize or restride it after capture")
        for name, (got_name, sig), want in zip(self._names, seen, self._expected):
            if got_name != name:
                break
            if sig != want:
                restrided = sig[:3] == want[:3]  # same address, shape and dtype: read in another layout
                what = "moved" if sig[0] != want[0] else "changed layout" if restrided else "changed shape or dtype"
                return (f"replay guard: {name} {what} since capture: was {_describe(want, restrided)}, "
                        f"now {_describe(sig, restrided)}; {fix}")
        now = [name for name, _ in seen]
        gone = [n for n in self._names if n not in now]
        new = [n for n in now if n not in self._names]
        return (f"replay guard: the tensors a graph may read changed since capture ({len(self._names)} then, "
                f"{len(now)} now; gone: {', '.join(gone) or '-'}; new: {', '.join(new) or '-'}); {fix}")
