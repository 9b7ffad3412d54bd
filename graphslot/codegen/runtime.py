"""What generated modules import: a small, stable surface. Its first use is the handshake (``require``); only
then does a module bind torch and the helpers it uses, so no import follows a statement in it."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from ..registry.base import ViewMaker as ViewMaker
from ..registry.buffers import allocate_buffer as allocate_buffer
from ..registry.buffers import allocate_staged as allocate_staged
from ..spec.hooks import FillContext as FillContext
from .handshake import MODULE_FORMAT as MODULE_FORMAT, GeneratedModuleMismatch as GeneratedModuleMismatch
from .handshake import require as require

foreach_copy = torch._foreach_copy_
# fill_from copies sources as data: autograd is off while it runs (the caller's mode
# restored after), the cheapest way there (torch.no_grad() costs several times more).
grad_enabled = torch.is_grad_enabled
set_grad_enabled = torch._C._set_grad_enabled


class SourceMismatch(Exception):
    """Raised by generated ``fill_from`` when a field's shape is not the step's; its
    except branch turns it into the interpreter's ``SlotError`` (``StepChecker.diagnose``)."""


def hook(hooks: Dict[str, Dict[str, Callable]], slot: str, kind: str) -> Callable:
    try:
        return hooks[slot][kind]
    except KeyError:
        expects = f"slot '{slot}': the generated code expects a {kind} hook, but none was bound"
        fix = "the module was generated for other params or hooks — regenerate it (graphslot generate)"
        raise RuntimeError(f"{expects}; {fix}") from None
