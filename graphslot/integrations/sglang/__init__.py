"""A drop-in for sglang 0.5.23's CUDA-graph buffer registry, backed by graphslot.

Same names, signatures and behaviour as ``sglang.srt.model_executor.
cuda_graph_buffer_registry``: :class:`CudaGraphBufferRegistry`, :class:`GraphSlot`,
:class:`PaddingPolicy`, :class:`FillContext`, :func:`same_tensor_view` and the three
factories. The factories are graphslot's shipped specs; slots registered from Python
become spec entries; ``fill_from`` / ``extract_buffer`` run graphslot's generated code.
:func:`install` switches sglang's runners to it, :func:`uninstall` back; with
``GRAPHSLOT_SGLANG=1`` sglang's plugin loader calls :func:`install` in every process
(:mod:`.patching`). Every difference from sglang is listed in ``docs/sglang.md``.

Importing this module does not import sglang: the pieces that belong to sglang (its
share pool, its parallel state) are looked up when they are used.
"""

from .factories import build_decode_registry, build_eager_registry, build_prefill_registry
from .patching import PATCH_TABLE, install, installed, uninstall
from .registry import CudaGraphBufferRegistry
from .sglang_env import SGLANG_POOL, SglangSharePool
from .slots import FillContext, GraphSlot, PaddingPolicy, SliceDim, same_tensor_view

__all__ = [
    "CudaGraphBufferRegistry", "GraphSlot", "PaddingPolicy", "FillContext", "SliceDim", "same_tensor_view",
    "build_decode_registry", "build_prefill_registry", "build_eager_registry", "SglangSharePool", "SGLANG_POOL",
    "install", "uninstall", "installed", "PATCH_TABLE",
]
