"""What generated modules import: a deliberately small, stable surface."""

from __future__ import annotations

from typing import Callable, Dict

import torch
from torch import Tensor

from ..framework.buffers import allocate_buffer
from ..framework.hooks import FillContext
from ..framework.registry import shallow_copy

foreach_copy = torch._foreach_copy_

__all__ = ["FillContext", "Tensor", "allocate_buffer", "foreach_copy", "hook", "shallow_copy"]


def hook(hooks: Dict[str, Dict[str, Callable]], slot: str, kind: str) -> Callable:
    try:
        return hooks[slot][kind]
    except KeyError:
        raise RuntimeError(
            f"slot '{slot}': the generated code expects a {kind} hook, but none was bound; the "
            "module was generated for other params or hooks — regenerate it (graphslot generate)"
        ) from None
