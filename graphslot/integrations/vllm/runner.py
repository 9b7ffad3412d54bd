"""graphslot's ``_prepare_inputs`` for vLLM 0.32's V1 model runner.

:func:`prepare_inputs` is what :mod:`.patching` puts in ``GPUModelRunner._prepare_inputs``. Per runner it builds
one registry of ``graphslot/slot_specs/vllm.yaml`` on the runner's own tensors (``buffers=``: vLLM's
``CpuGpuBuffer``\\ s become staged slots), lazily at the first step, which comes after ``initialize_kv_cache``; and
again when the runner's input batch was replaced (``may_reinitialize_input_batch``), since the block table and the
slot mapping belong to it. Each step then makes one :class:`~.step.VllmStep` and one ``fill_from``, which writes
every slot's host buffer and stages it to the device, and does the rest of vLLM's bookkeeping that is no slot
(``prev_positions``, ``num_accepted_tokens``), and returns what vLLM's returns. A runner whose configuration the
plugin does not replace (seen at its first step: a runner made without a worker, whose ``__init__`` refuses it, or
what only a built runner shows) gets no registry: vLLM's own ``_prepare_inputs`` prepares its steps, uncounted,
after one WARNING naming the feature. Nothing here imports vLLM.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch

from ...api import build
from ...log import get_logger
from ...registry.base import SlotRegistry
from ...spec.loading import shipped_spec_path
from .step import VllmStep
from .support import runner_refusals

SPEC = "vllm"
logger = get_logger(__name__)

#: Counters since the process started: ``steps`` (steps a runner filled), ``registries`` (registries built,
#: re-adoptions after an input batch was replaced included).
STATS: Dict[str, int] = {"steps": 0, "registries": 0}
#: "path" -> the spec registries are built from: None for the shipped one (:func:`use_spec`).
_SPEC_PATH: Dict[str, Optional[Path]] = {"path": None}


class RunnerFill:
    """One runner's registry, on the buffers of the input batch it was built for (``input_batch``); None for a
    runner handed back to vLLM."""

    __slots__ = ("input_batch", "registry", "__weakref__")

    def __init__(self, input_batch: Any, registry: Optional[SlotRegistry]):
        self.input_batch = input_batch
        self.registry = registry


#: runner -> its RunnerFill; a runner that goes away takes its registry with it.
_FILLS: "weakref.WeakKeyDictionary[Any, RunnerFill]" = weakref.WeakKeyDictionary()
#: runner -> the host buffer staging its ``positions`` (vLLM keeps none): pinned on CUDA; the device tensor itself
#: on the CPU build. Kept across re-adoptions, so its address never changes.
_POSITIONS_HOST: "weakref.WeakKeyDictionary[Any, torch.Tensor]" = weakref.WeakKeyDictionary()


def preset_for(device: torch.device) -> Optional[str]:
    """The spec's preset for a runner on ``device``: ``cpu`` for vLLM's CPU build, the defaults on a GPU."""
    return "cpu" if device.type == "cpu" else None


def positions_host(runner: Any) -> torch.Tensor:
    host = _POSITIONS_HOST.get(runner)
    if host is None:
        device = runner.positions
        if device.device.type == "cpu":
            host = device  # one tensor for both: staged in name only
        else:
            pin = bool(getattr(runner, "pin_memory", False))
            host = torch.zeros(device.shape, dtype=device.dtype, device="cpu", pin_memory=pin)
        _POSITIONS_HOST[runner] = host
    return host


class RunnerBuffers(Mapping):
    """What ``buffers=`` adopts from a runner: the slots vLLM keeps elsewhere or under another name (``named``),
    then any attribute of the runner of the slot's name, so a slot a fork adds for a runner attribute of its name
    (a ``CpuGpuBuffer``) is adopted as it is."""

    def __init__(self, runner: Any, named: Dict[str, Any]):
        self.runner = runner
        self.named = named

    def __getitem__(self, name: str) -> Any:
        if name in self.named:
            return self.named[name]
        value = getattr(self.runner, name, None)
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)


def adopted_buffers(runner: Any) -> RunnerBuffers:
    """The runner's tensors each slot adopts: a ``CpuGpuBuffer`` (``.cpu``, ``.gpu``) or a ``(host, device)`` pair
    for a staged slot. ``seq_lens``' host is vLLM's ``optimistic_seq_lens_cpu``; ``num_computed_tokens``' the
    input batch's state; ``block_table`` and ``slot_mapping`` are the one KV-cache group's. Iterating gives the
    shipped spec's slots; any other name is looked up on the runner."""
    batch = runner.input_batch
    group = batch.block_table[0]
    return RunnerBuffers(runner, {
        "input_ids": runner.input_ids,
        "positions": (positions_host(runner), runner.positions),
        "query_start_loc": runner.query_start_loc,
        "seq_lens": (runner.optimistic_seq_lens_cpu, runner.seq_lens),
        "num_computed_tokens": (batch.num_computed_tokens_cpu_tensor, runner.num_computed_tokens),
        "discard_request_mask": runner.discard_request_mask,
        "block_table": group.block_table,
        "slot_mapping": group.slot_mapping,
    })


def spec_path() -> Path:
    """The spec the registries are built from: the shipped ``vllm.yaml``, or the one :func:`use_spec` chose."""
    chosen = _SPEC_PATH["path"]
    return shipped_spec_path(SPEC) if chosen is None else chosen


def use_spec(path: Optional[Path]) -> None:
    """Build every registry from ``path`` (a fork's copy of ``vllm.yaml``; None: the shipped one) from the next step
    on: the registries built so far are dropped. ``graphslot verify`` checks a changed spec this way."""
    _SPEC_PATH["path"] = None if path is None else Path(path)
    _FILLS.clear()


def build_for(runner: Any, token_to_kv_slot: Any) -> RunnerFill:
    """A registry on ``runner``'s buffers; none (one WARNING) when it does something the plugin does not replace."""
    found = runner_refusals(runner, token_to_kv_slot)
    if found:
        logger.warning("graphslot.integrations.vllm does not support %s (%s on %s): vLLM's own _prepare_inputs "
                       "prepares this runner's steps (not counted in stats())", "; ".join(found),
                       type(runner).__name__, runner.device)
        return RunnerFill(runner.input_batch, None)
    device = torch.device(runner.device)
    preset = preset_for(device)
    max_blocks = runner.input_batch.block_table[0].max_num_blocks_per_req
    registry = build(spec_path(), device=device, max_bs=runner.max_num_reqs,
                     max_num_tokens=runner.max_num_tokens, params={"max_blocks": max_blocks}, preset=preset,
                     adopt=adopted_buffers(runner))
    STATS["registries"] += 1
    logger.info("vLLM %s on %s: spec '%s'%s (max_num_reqs=%d, max_num_tokens=%d, max_blocks=%d) on the runner's "
                "own buffers; slots %s", type(runner).__name__, device, SPEC, f" preset {preset}" if preset else "",
                runner.max_num_reqs, runner.max_num_tokens, max_blocks, ", ".join(registry.slot_names()))
    return RunnerFill(runner.input_batch, registry)


def fill_of(runner: Any, token_to_kv_slot: Any) -> RunnerFill:
    """``runner``'s RunnerFill, built at its first step and again when its input batch was replaced."""
    fill = _FILLS.get(runner)
    if fill is None or fill.input_batch is not runner.input_batch:
        fill = build_for(runner, token_to_kv_slot)
        _FILLS[runner] = fill
    return fill


def registry_of(runner: Any) -> Optional[SlotRegistry]:
    """The registry ``runner`` fills (None before its first step under the plugin)."""
    fill = _FILLS.get(runner)
    return None if fill is None else fill.registry


def prepare_inputs(runner: Any, scheduler_output: Any, num_scheduled_tokens: Any, token_to_kv_slot: Any,
                   vllms_own: Callable[..., Any]) -> Tuple[Any, ...]:
    """vLLM 0.32's ``_prepare_inputs`` without speculative decoding, M-RoPE, prompt embeds, async scheduling,
    context parallelism or LoRA: ``(logits_indices, None, 1)``, every slot filled once. A runner with any of them
    gets ``vllms_own`` (vLLM's ``_prepare_inputs``) instead."""
    fill = fill_of(runner, token_to_kv_slot)
    if fill.registry is None:
        return vllms_own(runner, scheduler_output, num_scheduled_tokens)
    num_tokens = scheduler_output.total_num_scheduled_tokens
    num_reqs = runner.input_batch.num_reqs
    if num_tokens <= 0 or num_reqs <= 0:
        raise ValueError(f"graphslot vLLM plugin: a step of {num_reqs} requests and {num_tokens} tokens "
                         "(vLLM schedules at least one of each)")
    step = VllmStep.of_runner(runner, num_scheduled_tokens)
    if step.num_tokens != num_tokens:
        raise ValueError(f"graphslot vLLM plugin: num_scheduled_tokens sums to {step.num_tokens}, but the "
                         f"scheduler output has {num_tokens} tokens")
    fill.registry.fill_from(step, raw_bs=num_reqs, padded_bs=num_reqs, raw_num_tokens=num_tokens,
                            padded_num_tokens=num_tokens)
    runner._compute_prev_positions(num_reqs)  # vLLM's own: host bookkeeping, no slot
    runner.num_accepted_tokens.np.fill(1)  # no speculative decoding: every request accepts its one token
    runner.num_accepted_tokens.gpu.fill_(1)
    if runner._pp_recv_work is not None:  # pipeline parallel: the async broadcast vLLM waits for before input_ids
        runner._pp_recv_work.wait()
        runner._pp_recv_work = None
    STATS["steps"] += 1
    query_start_loc = fill.registry.slot("query_start_loc").buffer[: num_reqs + 1]
    return query_start_loc[1:] - 1, None, 1
