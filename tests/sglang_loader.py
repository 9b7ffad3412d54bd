"""Import sglang's CUDA-graph buffer registry without the rest of sglang.

The compatibility suite (``tests/test_sglang_compat.py``) runs graphslot against the
real ``CudaGraphBufferRegistry`` of an installed sglang wheel (pinned: 0.5.23). Three of
its modules are needed: ``model_executor/cuda_graph_buffer_registry.py``,
``input_buffers.py`` and ``forward_batch_info.py`` (``ForwardBatch`` and
``compute_local_num_token_non_padded``). Importing them the ordinary way would run
``sglang/__init__.py`` and pull in kernels, distributed setup, model configs and
whatever else they import, none of which the registry needs and most of which does not
import on a CPU-only machine.

So this module puts minimal stand-ins into ``sys.modules`` for the heavy modules those
three import (only the names they use, none of them reached by the registry's code
paths except the parallel state below), and a bare ``sglang`` package whose
``__path__`` is the installed one, so that the three real files (and the light
``sglang.srt.environ``) load from the wheel. Nothing of sglang is copied here.

``PARALLEL`` is what the stand-in ``get_parallel()`` returns: the compat tests set its
``attn_tp_rank`` / ``attn_tp_size`` / ``num_dp_ranks`` (with ``parallel(...)``) the way a
real sglang process's runtime context would hold them.

``load()`` raises ``ImportError`` (with the reason) when sglang is not installed or
cannot be imported this way; the suite then skips.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from types import SimpleNamespace
from typing import Any, Dict, Optional

TARGET_VERSION = "0.5.23"

# What the stand-in get_parallel() reports; see parallel().
PARALLEL = SimpleNamespace(attn_tp_rank=0, attn_tp_size=1, num_dp_ranks=1)

_LOADED: Optional[SimpleNamespace] = None


@contextlib.contextmanager
def parallel(**values: Any):
    """Temporarily set attributes of the stand-in parallel state."""
    old = {k: getattr(PARALLEL, k) for k in values}
    for k, v in values.items():
        setattr(PARALLEL, k, v)
    try:
        yield PARALLEL
    finally:
        for k, v in old.items():
            setattr(PARALLEL, k, v)


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if package:
        mod.__path__ = []  # a package with nothing importable below it but stand-ins
    mod.__graphslot_stub__ = True
    return mod


def _placeholder(qualname: str):
    """A name imported at module scope but never reached by the registry's paths."""

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{qualname} is a graphslot test stand-in and must not be called")

    unavailable.__qualname__ = unavailable.__name__ = qualname.rsplit(".", 1)[-1]
    return unavailable


def _stand_ins() -> Dict[str, types.ModuleType]:
    p = _placeholder
    return {
        # sglang.srt.utils is a package importing most of sglang; the three modules use
        # a handful of platform probes and two helpers.
        "sglang.srt.utils": _module(
            "sglang.srt.utils", package=True,
            is_npu=lambda: False, is_cpu=lambda: False, is_hip=lambda: False,
            support_triton=lambda *a, **k: False,
            get_bool_env_var=lambda name, default="false": False,
        ),
        "sglang.srt.utils.common": _module(
            "sglang.srt.utils.common",
            ceil_align=lambda x, a: (x + a - 1) // a * a,
            is_pin_memory_available=lambda *a, **k: False,
        ),
        # Parallel / runtime state: the only stand-in the registry really uses.
        "sglang.srt.runtime_context": _module(
            "sglang.srt.runtime_context",
            get_parallel=lambda: PARALLEL,
            get_exec=p("get_exec"), get_flags=p("get_flags"), get_lora=p("get_lora"),
            mamba_cache_chunk_size=p("mamba_cache_chunk_size"),
        ),
        # Triton / JIT kernels.
        "sglang.kernels": _module("sglang.kernels", package=True),
        "sglang.kernels.ops": _module("sglang.kernels.ops", package=True),
        "sglang.kernels.ops.attention": _module("sglang.kernels.ops.attention", package=True),
        "sglang.kernels.ops.attention.clamp_position": _module(
            "sglang.kernels.ops.attention.clamp_position", clamp_position=p("clamp_position")),
        "sglang.kernels.ops.attention.position": _module(
            "sglang.kernels.ops.attention.position", compute_position_triton=p("compute_position_triton")),
        # Model configs, distributed, KV canary, DP attention, speculative decoding.
        "sglang.srt.configs": _module("sglang.srt.configs", package=True),
        "sglang.srt.configs.hybrid_arch": _module(
            "sglang.srt.configs.hybrid_arch", mambaish_config=p("mambaish_config")),
        "sglang.srt.distributed": _module("sglang.srt.distributed", package=True),
        "sglang.srt.distributed.utils": _module(
            "sglang.srt.distributed.utils", all_gather_single=p("all_gather_single")),
        "sglang.srt.kv_canary": _module("sglang.srt.kv_canary", package=True),
        "sglang.srt.kv_canary.req_to_expected_token_ids_manager": _module(
            "sglang.srt.kv_canary.req_to_expected_token_ids_manager",
            compute_req_all_ids_info=p("compute_req_all_ids_info")),
        "sglang.srt.layers": _module("sglang.srt.layers", package=True),
        "sglang.srt.layers.dp_attention": _module(
            "sglang.srt.layers.dp_attention",
            DpPaddingMode=type("DpPaddingMode", (), {}),
            dp_slot_in=p("dp_slot_in"),
            set_dp_buffer_len_from_batch=p("set_dp_buffer_len_from_batch"),
            set_is_extend_in_batch=p("set_is_extend_in_batch"),
            world_dp_gather_enabled=p("world_dp_gather_enabled"),
        ),
        "sglang.srt.speculative": _module("sglang.srt.speculative", package=True),
        "sglang.srt.speculative.spec_info": _module(
            "sglang.srt.speculative.spec_info", SpecInputType=type("SpecInputType", (), {})),
        # ForwardBatch's base class: DeepSeek MHA helpers (kernels, DCP) none of the
        # registry's code reaches.
        "sglang.srt.model_executor.forward_batch_deepseek_mha_mixin": _module(
            "sglang.srt.model_executor.forward_batch_deepseek_mha_mixin",
            ForwardBatchDeepSeekMHAMixin=type("ForwardBatchDeepSeekMHAMixin", (), {}),
        ),
    }


def load() -> SimpleNamespace:
    """The three sglang modules (``registry``, ``input_buffers``, ``fbi``) and the
    installed ``version``; ImportError when that is not possible."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    spec = importlib.util.find_spec("sglang") if "sglang" not in sys.modules else None
    existing = sys.modules.get("sglang")
    if existing is not None and not getattr(existing, "__graphslot_stub__", False):
        raise ImportError("the real sglang package is already imported in this process; "
                          "the compat suite needs to load its registry in isolation")
    if existing is None and (spec is None or not spec.submodule_search_locations):
        raise ImportError(f"sglang is not installed (pip install --no-deps sglang=={TARGET_VERSION} msgspec)")
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if existing is None:
        sys.modules["sglang"] = _module("sglang", __version__=version)
        sys.modules["sglang"].__path__ = list(spec.submodule_search_locations)
        for name, mod in _stand_ins().items():
            sys.modules.setdefault(name, mod)
    try:
        registry = importlib.import_module("sglang.srt.model_executor.cuda_graph_buffer_registry")
        input_buffers = importlib.import_module("sglang.srt.model_executor.input_buffers")
        fbi = importlib.import_module("sglang.srt.model_executor.forward_batch_info")
    except Exception as exc:  # any failure means: no compat run here, say why
        raise ImportError(f"cannot import sglang {version}'s buffer registry with stand-ins: "
                          f"{type(exc).__name__}: {exc}") from exc
    _LOADED = SimpleNamespace(registry=registry, input_buffers=input_buffers, fbi=fbi, version=version)
    return _LOADED
