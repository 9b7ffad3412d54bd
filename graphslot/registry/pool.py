"""Sharing slot buffers between registries.

Two runners (say decode and a draft model's decode) that mirror the same batch field
can share one physical buffer, so capture and replay see one address whichever runner
filled it. Buffers are keyed by ``(name, numel, dtype, device)``: the first registrant
is canonical and later ones adopt it (viewed to their own shape), whatever the order;
different sizes never share. The pool holds buffers weakly, so it never keeps a dead
registry's memory alive.

Registration is thread-safe. Sharers must agree on the buffer's initial value (a
``fill_once`` or ``fill_sentinel`` pad value, else zero): one physical buffer cannot
start with two, so a disagreement is an error naming both. Filling is not
synchronised: a pool's buffers have one writer at a time (the engine runs the
forwards that share them one after another, as sglang's pool assumes).
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
    """What ``build_registry(share_pool=...)`` accepts: anything that, given a freshly
    allocated zero buffer, returns the tensor the slot is to use and whether it is
    *fresh* (then the registry fills it with ``init_value``, ``None`` meaning zeros,
    after sharing). :class:`BufferPool` is graphslot's; an engine may bring its own
    (``graphslot.integrations.sglang`` delegates to sglang's pool)."""

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]: ...


class BufferPool:
    def __init__(self) -> None:
        self._buffers: "weakref.WeakValueDictionary[PoolKey, torch.Tensor]" = weakref.WeakValueDictionary()
        self._init: Dict[PoolKey, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(name: str, tensor: torch.Tensor) -> PoolKey:
        return (name, tensor.numel(), tensor.dtype, tensor.device)

    def share(self, name: str, tensor: torch.Tensor, init_value: Any = None) -> Tuple[torch.Tensor, bool]:
        """The canonical buffer for ``tensor``'s key, viewed to its shape, and whether
        ``tensor`` itself became canonical (so the caller initialises it with
        ``init_value``; ``None`` means zeros)."""
        key = self.key(name, tensor)
        init = 0 if init_value is None else init_value
        with self._lock:
            canonical = self._buffers.get(key)
            if canonical is None:
                self._buffers[key] = tensor
                self._init[key] = init
                return tensor, True
            first = self._init[key]
        if first != init:
            raise SlotError(
                f"slot '{name}': shared buffer ({tensor.numel()} x {tensor.dtype} on {tensor.device}) "
                f"was first registered with initial value {first!r}, this registry needs {init!r}; "
                "give both the same pad value, or build one without share_pool"
            )
        return canonical.view(tensor.shape), False

    def __len__(self) -> int:
        return len(self._buffers)

    def __bool__(self) -> bool:
        return True  # an empty pool is still a pool (``share_pool=BufferPool()`` must share)
