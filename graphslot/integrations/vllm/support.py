"""What the vLLM plugin runs on, and the one-line refusals of everything else.

The plugin replaces ``GPUModelRunner._prepare_inputs`` of vLLM 0.32.0's V1 runner, line by line (FINDINGS of
issue 42, docs/vllm.md), so it refuses another vLLM release (:func:`check_version`) and every configuration whose
``_prepare_inputs`` takes a path it does not replace (:func:`config_refusals`, :func:`runner_refusals`). Each
refusal is a :class:`VllmRefused` whose message is one line naming what is not supported and ``GRAPHSLOT_VLLM=0``.
Nothing here imports vLLM: the caller passes what it read.
"""

from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

#: The vLLM release the plugin is built for (``vllm.__version__``'s release part must equal it).
VLLM_VERSION = "0.32.0"
SWITCH_OFF = "set GRAPHSLOT_VLLM=0 to run stock vLLM"


class VllmRefused(RuntimeError):
    """graphslot's vLLM plugin cannot run this vLLM, or this configuration of it."""


def release(version: str) -> Optional[Tuple[int, ...]]:
    """``version``'s release numbers (``0.32.0+cu130`` -> ``(0, 32, 0)``); None for a pre-, post- or dev release
    (``0.32.0rc1``, ``0.32.0.dev3``), which is other code than the release."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(\+[A-Za-z0-9.]+)?", version.strip())
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def check_version(version: str) -> None:
    """VllmRefused unless ``version`` (``vllm.__version__``) is the release the plugin is built for."""
    if release(version) != release(VLLM_VERSION):
        raise VllmRefused(f"graphslot.integrations.vllm is built for vLLM {VLLM_VERSION}, found vLLM {version}: "
                          f"install vllm=={VLLM_VERSION}, or {SWITCH_OFF}")


def config_refusals(config: Any) -> List[str]:
    """What ``config`` (a ``VllmConfig``) turns on that the plugin does not replace, each in words with the
    setting that turns it off; empty when it runs."""
    model = getattr(config, "model_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    parallel = getattr(config, "parallel_config", None)
    found = []
    if getattr(config, "use_v2_model_runner", False):
        found.append("Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner)")
    if getattr(config, "speculative_config", None) is not None:
        found.append("speculative decoding (speculative_config)")
    if model is not None and getattr(model, "uses_mrope", False):
        found.append("M-RoPE (a multimodal rope model)")
    if model is not None and getattr(model, "enable_prompt_embeds", False):
        found.append("prompt embeds (enable_prompt_embeds)")
    if scheduler is not None and getattr(scheduler, "async_scheduling", False):
        found.append("async scheduling (--no-async-scheduling turns it off)")
    if parallel is not None and getattr(parallel, "decode_context_parallel_size", 1) > 1:
        found.append(f"decode context parallelism (DCP={parallel.decode_context_parallel_size})")
    if parallel is not None and getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        found.append(f"prefill context parallelism (PCP={parallel.prefill_context_parallel_size})")
    if getattr(config, "lora_config", None) is not None:
        found.append("LoRA (lora_config)")
    return found


def runner_refusals(runner: Any, token_to_kv_slot: Any) -> List[str]:
    """What a built runner (a ``GPUModelRunner`` after ``initialize_kv_cache``) does that the plugin does not
    replace: its configuration's refusals, then its KV-cache groups (one group, whose block table maps tokens to
    KV slots: ``token_to_kv_slot`` is vLLM's ``SlotMappingMode.TOKEN_TO_KV_SLOT``) and async input state."""
    found = config_refusals(runner.vllm_config)
    groups = runner.input_batch.block_table.block_tables
    if len(groups) != 1:
        found.append(f"{len(groups)} KV-cache groups (a hybrid or multi-group model; the plugin fills one)")
    modes = sorted({str(getattr(group.slot_mapping_mode, "value", group.slot_mapping_mode)) for group in groups
                    if group.slot_mapping_mode != token_to_kv_slot})
    if modes:
        found.append(f"KV-cache groups without a token slot mapping (slot_mapping_mode {', '.join(modes)})")
    if getattr(runner.input_batch, "prev_sampled_token_ids", None) is not None:
        found.append("async scheduling (the previous step's sampled tokens are on the device)")
    return found


def refuse(found: List[str], where: str) -> None:
    """VllmRefused naming every feature in ``found`` (``where``: what was checked), unless it is empty."""
    if found:
        features = "; ".join(found)
        raise VllmRefused(f"graphslot.integrations.vllm does not support {features} ({where}): turn it off, or "
                          f"{SWITCH_OFF}")
