"""Switch sglang 0.5.23's runners to the drop-in, and back, without editing sglang.

sglang's runner modules bind the registry names when they are imported
(``from ...cuda_graph_buffer_registry import build_decode_registry``) and look them up
in their own globals when they build a registry. :func:`install` therefore replaces
the names in the registry module (what any later importer gets) and in each runner
module already imported (what it already bound), per :data:`PATCH_TABLE`; it never
imports a runner. :func:`uninstall` puts sglang's objects back wherever the drop-in's
are, runners imported in between included. Registries built before :func:`install`
stay sglang's, so it must run before sglang builds its runners, in every process: with
``GRAPHSLOT_SGLANG=1`` sglang's general-plugin loader (entry point group
``sglang.srt.plugins``, run at the start of each scheduler, engine and DP-controller
process) calls :func:`load_plugin`, which installs.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Dict, Tuple

from ...env import SGLANG

REGISTRY_MODULE = "sglang.srt.model_executor.cuda_graph_buffer_registry"
RUNNERS = "sglang.srt.model_executor.runner."
#: (module, names it binds): the registry module itself, then the runner modules
#: that import registry names (piecewise, breakable and full prefill graphs are all
#: backends of the prefill runner in 0.5.23; the eager runner serves eager decode
#: and extend). ``early_verify_metadata`` binds the class for an annotation only.
PATCH_TABLE: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (REGISTRY_MODULE, ("CudaGraphBufferRegistry", "GraphSlot", "PaddingPolicy", "FillContext",
                       "build_decode_registry", "build_prefill_registry", "build_eager_registry")),
    (RUNNERS + "decode_cuda_graph_runner", ("CudaGraphBufferRegistry", "GraphSlot", "PaddingPolicy",
                                            "build_decode_registry")),
    (RUNNERS + "prefill_cuda_graph_runner", ("CudaGraphBufferRegistry", "build_prefill_registry")),
    (RUNNERS + "eager_runner", ("build_eager_registry",)),
)

_LOCK = threading.Lock()
_ORIGINALS: Dict[str, Any] = {}  # name -> sglang's object, while installed


def _drop_in() -> Dict[str, Any]:
    from . import factories, registry, slots

    return {"CudaGraphBufferRegistry": registry.CudaGraphBufferRegistry, "GraphSlot": slots.GraphSlot,
            "PaddingPolicy": slots.PaddingPolicy, "FillContext": slots.FillContext,
            "build_decode_registry": factories.build_decode_registry,
            "build_prefill_registry": factories.build_prefill_registry,
            "build_eager_registry": factories.build_eager_registry}


def install() -> None:
    """Make sglang's registry module and its imported runners use the drop-in.
    Idempotent; a second call also patches runners imported since the first."""
    with _LOCK:
        ours = _drop_in()
        registry = importlib.import_module(REGISTRY_MODULE)
        for name in PATCH_TABLE[0][1]:
            current = getattr(registry, name)
            if current is not ours[name]:
                _ORIGINALS[name] = current
        for module_name, names in PATCH_TABLE:
            module = sys.modules.get(module_name)
            if module is None:
                continue  # imported later, it binds the names from the patched registry module
            for name in names:
                if getattr(module, name, None) is _ORIGINALS.get(name):
                    setattr(module, name, ours[name])


def uninstall() -> None:
    """Put sglang's own objects back wherever the drop-in's are. Idempotent."""
    with _LOCK:
        if not _ORIGINALS:
            return
        ours = _drop_in()
        for module_name, names in PATCH_TABLE:
            module = sys.modules.get(module_name)
            for name in names if module is not None else ():
                if getattr(module, name, None) is ours[name]:
                    setattr(module, name, _ORIGINALS[name])
        _ORIGINALS.clear()


def installed() -> bool:
    """Whether sglang's registry module currently holds the drop-in."""
    module = sys.modules.get(REGISTRY_MODULE)
    return module is not None and getattr(module, "build_decode_registry", None) is _drop_in()[
        "build_decode_registry"]


def load_plugin() -> None:
    """sglang's general-plugin entry point: :func:`install` when ``GRAPHSLOT_SGLANG``
    is on (``1/true/yes/on``); installing graphslot alone never switches sglang."""
    if SGLANG.enabled():
        install()
