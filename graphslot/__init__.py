"""graphslot: declarative static input buffers for CUDA-graph runners.

YAML specs declare each batch field ("slot"); pydantic validates them; a generator emits
straight-line ``fill_from`` / ``extract`` code; graph runners consume it.
"""

import warnings

# A torch without NumPy beside it warns on import; graphslot never uses NumPy. Silence
# that one message for this import only (the filter is restored on leaving the block).
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from ._version import __version__  # noqa: E402
from .api import build_registry
from .framework.errors import SlotError, SpecError, SpecIssue
from .framework.hooks import BUILTIN_HOOKS, CaptureContext, FillContext
from .framework.loading import load_spec, parse_spec, shipped_spec_names
from .framework.model import RegistrySpec, SlotSpec
from .framework.pool import BufferPool
from .framework.registry import InterpretedRegistry, Slot, SlotRegistry
from .framework.resolve import resolve_params

__all__ = [
    "__version__", "build_registry", "load_spec", "parse_spec", "shipped_spec_names", "RegistrySpec",
    "SlotSpec", "SpecError", "SpecIssue", "SlotError", "FillContext", "CaptureContext", "BUILTIN_HOOKS",
    "BufferPool", "Slot", "SlotRegistry", "InterpretedRegistry", "resolve_params",
]
