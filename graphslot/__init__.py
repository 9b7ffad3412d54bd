"""graphslot: declarative static input buffers for CUDA-graph runners.

YAML specs declare each batch field ("slot"); pydantic validates them; a generator emits
straight-line ``fill_from`` / ``extract`` code; graph runners consume it.
"""

from ._version import __version__
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
