"""graphslot as vLLM 0.32's model-runner inputs: a vLLM general plugin, off unless ``GRAPHSLOT_VLLM=1``.

With it on, vLLM's V1 model runner (``GPUModelRunner``, and ``CPUModelRunner`` on the CPU build) prepares each
step's inputs with graphslot: ``GPUModelRunner._prepare_inputs`` becomes :func:`.runner.prepare_inputs`, which
fills a registry of ``graphslot/slot_specs/vllm.yaml`` built on the runner's own buffers, once per step, in place
of vLLM's own writes. :func:`install` / :func:`uninstall` switch it by hand; :func:`stats` counts the steps filled;
:func:`registry_of` is a runner's registry. docs/vllm.md: switching it on, and every difference from stock vLLM.

Importing this package does not import vLLM: :func:`install` does.
"""

from .patching import install, installed, load_plugin, stats, uninstall
from .runner import adopted_buffers, registry_of
from .support import VLLM_VERSION, VllmRefused

__all__ = ["install", "uninstall", "installed", "load_plugin", "stats", "registry_of", "adopted_buffers",
           "VllmRefused", "VLLM_VERSION"]
