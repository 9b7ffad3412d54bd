"""What generated modules import: a deliberately small, stable surface."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from ..framework.buffers import allocate_buffer
from ..framework.hooks import FillContext
from ..framework.registry import ViewMaker

foreach_copy = torch._foreach_copy_

__all__ = ["FillContext", "SourceMismatch", "ViewMaker", "allocate_buffer", "foreach_copy", "hook"]


class SourceMismatch(Exception):
    """Raised by generated ``fill_from`` when a field's shape is not the step's; its
    except branch turns it into the interpreter's ``SlotError`` (``StepChecker.diagnose``)."""


def hook(hooks: Dict[str, Dict[str, Callable]], slot: str, kind: str) -> Callable:
    try:
        return hooks[slot][kind]
    except KeyError:
        raise RuntimeError(
            f"slot '{slot}': the generated code expects a {kind} hook, but none was bound; the "
            "module was generated for other params or hooks — regenerate it (graphslot generate)"
        ) from None
