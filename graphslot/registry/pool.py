"""Sharing slot buffers between registries (say decode and a draft model's decode mirroring one field), so
capture and replay see one address whichever runner filled it. Keyed by ``(name, numel, dtype, device)``: the
first registrant is canonical, later ones view it to their shape; held weakly. Registration is thread-safe;
sharers must agree on the initial value; filling is not synchronised (one writer at a time, as sglang's pool).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Protocol, Tuple, runtime_checkable

import torch

from ..spec.errors import SlotError

PoolKey = Tuple[str, int, torch.dtype, torch.device]


@runtime_checkable
class SharePool(Protocol):
    """A pool ``build_registry(buffers=...)`` accepts: given a fresh zero buffer, the tensor the slot is to use
    and whether it is *fresh* (then filled with ``init_value``). An engine may bring its own (sglang's)."""

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]: ...


class BufferPool:
    def __init__(self) -> None:
        self._buffers: "weakref.WeakValueDictionary[PoolKey, torch.Tensor]" = weakref.WeakValueDictionary()
        self._init: Dict[PoolKey, Any] = {}
        self._lock = threading.Lock()

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]:
        """The canonical buffer viewed to ``tensor``'s shape, and whether ``tensor`` became it (to initialise)."""
        key = (name, tensor.numel(), tensor.dtype, tensor.device)
        init = 0 if init_value is None else init_value
        with self._lock:
            canonical = self._buffers.get(key)
            if canonical is None:
                self._buffers[key], self._init[key] = tensor, init
                return tensor, True
            first = self._init[key]
        if first != init:
            shared = f"shared buffer ({tensor.numel()} x {tensor.dtype} on {tensor.device})"
            needs = f"was first registered with initial value {first!r}, this registry needs {init!r}"
            raise SlotError(
                f"slot '{name}': {shared} {needs}; give both the same pad value, or build one without share_pool"
            )
        return canonical.view(tensor.shape), False

    def __len__(self) -> int:
        return len(self._buffers)

    def __bool__(self) -> bool:
        return True  # an empty pool is still a pool (``share_pool=BufferPool()`` must share)
