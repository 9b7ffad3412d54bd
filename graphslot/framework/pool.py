"""Sharing slot buffers between registries.

Two runners (say decode and a draft model's decode) that mirror the same batch field
can share one physical buffer, so capture and replay see one address whichever runner
filled it. Buffers are keyed by ``(name, numel, dtype, device)``: the first registrant
is canonical and later ones adopt it (viewed to their own shape), whatever the order;
different sizes never share. The pool holds buffers weakly, so it never keeps a dead
registry's memory alive.
"""

from __future__ import annotations

import weakref
from typing import Tuple

import torch

PoolKey = Tuple[str, int, torch.dtype, torch.device]


class BufferPool:
    def __init__(self) -> None:
        self._buffers: "weakref.WeakValueDictionary[PoolKey, torch.Tensor]" = weakref.WeakValueDictionary()

    @staticmethod
    def key(name: str, tensor: torch.Tensor) -> PoolKey:
        return (name, tensor.numel(), tensor.dtype, tensor.device)

    def share(self, name: str, tensor: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """The canonical buffer for ``tensor``'s key, viewed to its shape, and whether
        ``tensor`` itself became canonical (so the caller initialises it)."""
        key = self.key(name, tensor)
        canonical = self._buffers.get(key)
        if canonical is None:
            self._buffers[key] = tensor
            return tensor, True
        return canonical.view(tensor.shape), False

    def __len__(self) -> int:
        return len(self._buffers)

    def __bool__(self) -> bool:
        return True  # an empty pool is still a pool (``share_pool=BufferPool()`` must share)


GLOBAL_POOL = BufferPool()
