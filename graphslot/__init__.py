"""graphslot: declarative static input buffers for CUDA-graph runners.

YAML specs declare each batch field ("slot"); pydantic validates them; a generator emits
straight-line ``fill_from`` / ``extract`` code; graph runners consume it.

The spec toolchain (``graphslot validate/show/schema/generate``) never imports torch.
"""

import importlib

from ._version import __version__
from .spec.errors import SlotError, SpecError, SpecIssue

# Public names, loaded on first access (PEP 562): ``import graphslot`` costs only the
# version and the error types; the spec model (pydantic) loads when a spec is first
# read, and torch when a registry is first built.
_TORCH_FREE = {
    "load_spec": ".spec.loading",
    "parse_spec": ".spec.loading",
    "spec_from_dict": ".spec.loading",
    "shipped_spec_names": ".spec.loading",
    "RegistrySpec": ".spec.model",
    "SlotSpec": ".spec.model",
    "resolve_params": ".spec.resolve",
    "Live": ".spec.live",
    "FillContext": ".spec.hooks",
    "CaptureContext": ".spec.hooks",
    "BUILTIN_HOOKS": ".spec.hooks",
}
_TORCH = {
    "build_registry": ".api",
    "BufferPool": ".registry.buffers",
    "SharePool": ".registry.buffers",
    "Slot": ".registry.base",
    "SlotRegistry": ".registry.base",
    "InterpretedRegistry": ".registry.interpreter",
}


def __getattr__(name):
    module_name = _TORCH_FREE.get(name) or _TORCH.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _TORCH:
        from .spec.dtypes import import_torch

        import_torch()
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_TORCH_FREE) | set(_TORCH))


__all__ = [
    "__version__", "SpecError", "SpecIssue", "SlotError",
    "load_spec", "parse_spec", "spec_from_dict", "shipped_spec_names", "RegistrySpec", "SlotSpec", "resolve_params",
    "Live", "FillContext", "CaptureContext", "BUILTIN_HOOKS",
    "build_registry", "BufferPool", "SharePool", "Slot", "SlotRegistry", "InterpretedRegistry",
]
