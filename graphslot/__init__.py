"""graphslot: declarative static input buffers for CUDA-graph runners.

YAML specs declare each batch field ("slot"); pydantic validates them; a generator emits
straight-line ``fill_from`` / ``extract`` code; graph runners consume it.

The spec toolchain (``graphslot validate/show/schema/generate``) never imports torch.
The names that need it (``build_registry``, the registry classes, ``BufferPool``) are
imported on first use (PEP 562), so ``import graphslot`` alone stays light.
"""

import importlib

from ._version import __version__
from .spec.dtypes import import_torch
from .spec.errors import SlotError, SpecError, SpecIssue
from .spec.hooks import BUILTIN_HOOKS, CaptureContext, FillContext
from .spec.live import Live
from .spec.loading import load_spec, parse_spec, shipped_spec_names, spec_from_dict
from .spec.model import RegistrySpec, SlotSpec
from .spec.resolve import resolve_params


# Public names whose modules import torch: loaded on first access.
_LAZY = {
    "build_registry": ".api",
    "BufferPool": ".registry.pool",
    "SharePool": ".registry.pool",
    "Slot": ".registry.base",
    "SlotRegistry": ".registry.base",
    "InterpretedRegistry": ".registry.interpreter",
}


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import_torch()
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__", "build_registry", "load_spec", "parse_spec", "spec_from_dict", "shipped_spec_names",
    "RegistrySpec", "Live",
    "SlotSpec", "SpecError", "SpecIssue", "SlotError", "FillContext", "CaptureContext", "BUILTIN_HOOKS",
    "BufferPool", "SharePool", "Slot", "SlotRegistry", "InterpretedRegistry", "resolve_params",
]
