"""``graphslot verify graphslot.integrations.vllm.verify:target``: the vLLM plugin's spec checked inside vLLM 0.32.

vLLM's CPU build captures no graphs, so verify runs the plugin's workload (:mod:`.workload`) end to end and compares
greedy tokens, request by request:

- **clean**: with the plugin, twice (the run must be deterministic), and against stock vLLM's tokens;
- **poisoned tails**: for each slot whose tail the fill leaves untouched (rows past the step's ``R`` or ``T`` that no
  policy resets to the end of the buffer: ``keep_pad``, ``foreach_copy``, and ``slot_mapping`` under the preset
  ``cpu``), one slot at a time, after every step's fill the tail is poisoned with the two patterns of
  :mod:`graphslot.tools.poison` (the step's real rows repeated; other values the slot has held, or flipped bools);
  the tokens must equal the clean run's;
- **stale-input audit**: every tensor of the runner and of its input batch (and its block table) that is neither a
  slot's buffer nor declared vLLM state (:data:`DECLARED_STATE`) is poisoned before every step's
  ``_prepare_inputs``. One the step rewrites before the forward loses the poison; one the step reads as it was is
  a per-step input the spec does not fill, and changes tokens: reported as a stale input.

The report is :class:`graphslot.tools.verify_report.VerifyReport`, printed as for a graph runner.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ...tools.audit import ExternalInput
from ...tools.poison import PATTERNS, Poisoner, hostile_name
from ...tools.verify_report import SlotVerdict, VerifyReport
from . import patching
from . import runner as runner_fill
from .workload import Wrap, generate, in_process_engine_env, tiny_engine

#: vLLM state the step reads as the engine keeps it (not a per-step input a spec fills): name -> why. Each is read
#: stale by the workload's steps (scrambled, the tokens change); the sampling parameters are not (greedy).
DECLARED_STATE = {
    "input_batch.token_ids_cpu_tensor": "the requests' token table (prompt and sampled tokens), vLLM's state",
    "input_batch.num_tokens_no_spec_cpu_tensor": "each request's token count, vLLM's state",
}


class StaleInput(ExternalInput):
    """A tensor of vLLM's runner that a step reads as it was before the step: no slot fills it."""

    def describe(self) -> str:
        return (f"{self.name} {list(self.shape)} {self.dtype}: poisoned before each step's _prepare_inputs, the "
                "tokens change, so the step reads it stale; make it a slot of vllm.yaml (or, if it is vLLM's "
                "state, declare it in graphslot.integrations.vllm.verify.DECLARED_STATE)")


def untouched_tail(slot: Any) -> bool:
    """Whether the fill (padded = raw) leaves rows past the step's count as they were."""
    spec = slot.resolved
    return spec.axis.sliced and not ((spec.resets_tail or spec.repeats_last) and spec.to_capacity)


def poison_tail(slot: Any, poisoner: Poisoner, reqs: int, tokens: int, pattern: str) -> None:
    """Rows ``[count:capacity]`` of the slot's device buffer, and of its host buffer where that is another tensor and
    not vLLM's state (``copy_from_fb``), poisoned with ``pattern``."""
    raw = slot.count(reqs, tokens)
    capacity = slot.buffer.shape[slot.resolved.slice_dim]
    poisoner.observe(slot, raw)
    poisoner.write(slot, raw, capacity, pattern)
    host = slot.host  # None for a slot a fork adds on the device alone
    if host is not None and host is not slot.buffer and slot.resolved.copy_from_fb:
        dim = slot.resolved.slice_dim
        host.narrow(dim, raw, capacity - raw).copy_(slot.buffer.narrow(dim, raw, capacity - raw))


def tensors_of(runner: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor attribute of the runner, its input batch and the KV group's block table, by name (a
    ``CpuGpuBuffer``'s two as ``name.cpu`` / ``name.gpu``; one tensor once)."""
    owners = [("runner", runner), ("input_batch", runner.input_batch),
              ("block_table", runner.input_batch.block_table[0])]
    for owner, obj in owners:
        for name, value in sorted(vars(obj).items()):
            if isinstance(value, torch.Tensor):
                yield f"{owner}.{name}", value
            elif isinstance(getattr(value, "cpu", None), torch.Tensor):
                yield f"{owner}.{name}.cpu", value.cpu
                if value.gpu is not value.cpu:
                    yield f"{owner}.{name}.gpu", value.gpu


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def audit_candidates(runner: Any, registry: Any) -> Dict[str, torch.Tensor]:
    """The runner's tensors that are neither a slot's buffer (sharing its storage) nor declared state."""
    slots = {storage(t) for s in registry.active for t in s.buffers()}
    found: Dict[str, torch.Tensor] = {}
    seen = set()
    for name, tensor in tensors_of(runner):
        key = storage(tensor)
        if tensor.numel() == 0 or key in slots or key in seen or name in DECLARED_STATE:
            continue
        seen.add(key)
        found[name] = tensor
    return found


def scramble(tensor: torch.Tensor) -> None:
    """Garbage a stale read would see: bools flipped, floats + 1, integers each the next value among those the
    tensor holds and 0 and 1 (in the range an index tensor already uses)."""
    with torch.no_grad():
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        elif tensor.dtype.is_floating_point:
            tensor.add_(1)
        else:
            domain = torch.unique(torch.cat([tensor.flatten(), tensor.new_tensor([0, 1])]))
            nxt = torch.searchsorted(domain, tensor.flatten().contiguous(), right=True) % domain.numel()
            tensor.copy_(domain[nxt].reshape(tensor.shape))


def differing(a: List[List[int]], b: List[List[int]]) -> List[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


class WorkloadRuns:
    """The workload run on one engine, as often as the checks ask; a failed run is sticky."""

    def __init__(self, llm: Any):
        self.llm = llm
        #: The error of a run that failed: vLLM's in-process engine does not run again after a step raised (its
        #: next run hangs), so the checks after it are not run.
        self.failed: Optional[str] = None

    def run(self, wrap: Optional[Wrap] = None) -> Tuple[Optional[List[List[int]]], Optional[str]]:
        """The workload's tokens with the plugin (``wrap`` around it), or the error it raised."""
        try:
            return generate(self.llm, wrap), None
        except Exception as exc:  # noqa: BLE001 - a poisoned run that fails is the finding
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc).strip() else ''}"
            return None, self.failed


def tail_leaks(runs: WorkloadRuns, slot: Any, clean: List[List[int]],
               progress: Callable[[str], None]) -> List[Dict[str, Any]]:
    """The workload with the slot's tail poisoned after every step's fill, once per pattern (none after a failed
    run): each pattern whose run fails or whose tokens differ from ``clean``."""
    poisoner = Poisoner()
    leaks: List[Dict[str, Any]] = []
    for pattern in PATTERNS:
        progress(f"{slot.name}: tail poisoned ({pattern})")

        def poisoned(inner, runner, scheduler_output, counts, pattern=pattern):
            returned = inner(runner, scheduler_output, counts)
            poison_tail(slot, poisoner, runner.input_batch.num_reqs, scheduler_output.total_num_scheduled_tokens,
                        pattern)
            return returned

        if runs.failed is not None:
            break
        tokens, error = runs.run(poisoned)
        name = pattern if pattern == "stale" else hostile_name(slot.buffer.dtype)
        if error is not None:
            leaks.append({"pattern": name, "requests": [], "error": error})
        elif tokens != clean:
            leaks.append({"pattern": name, "requests": differing(tokens, clean)})
    return leaks


def leaks_verdict(slot: Any, leaks: List[Dict[str, Any]]) -> SlotVerdict:
    """The verdict on a slot whose tail was poisoned with every pattern: UNSAFE, naming the first leak, if any."""
    spec = slot.resolved
    if leaks:
        first = leaks[0]
        what = (f"the run fails with the tail poisoned ({first['error']})" if first.get("error") else
                f"poisoning the tail ({first['pattern']}) changes the tokens of requests {first['requests']}")
        return SlotVerdict(slot.name, spec.padding, "UNSAFE", f"{what}; reset the tail every step "
                           "(padding zero or fill_sentinel with reset_to: capacity)", leaks)
    patterns = f"stale, {hostile_name(slot.buffer.dtype)}"
    return SlotVerdict(slot.name, spec.padding, "safe", f"tail poisoned ({patterns}) after every step's fill: "
                       "the tokens equal the clean run's")


def tail_verdict(runs: WorkloadRuns, slot: Any, clean: List[List[int]],
                 progress: Callable[[str], None]) -> SlotVerdict:
    """The poisoned-tails check of one slot (the module doc)."""
    spec = slot.resolved
    if not untouched_tail(slot):
        what = "repeats the head's last row" if spec.repeats_last else f"is reset to {spec.tail_value!r}"
        return SlotVerdict(slot.name, spec.padding, "safe", f"tail {what} to the end of the buffer every step")
    if runs.failed is not None:
        return SlotVerdict(slot.name, spec.padding, "unverified", "not run: an earlier poisoned run failed")
    return leaks_verdict(slot, tail_leaks(runs, slot, clean, progress))


def stale_inputs(runs: WorkloadRuns, runner: Any, registry: Any, clean: List[List[int]],
                 progress: Callable[[str], None]) -> List[ExternalInput]:
    """The stale-input audit (the module doc): each candidate poisoned before every step, one run each."""
    found: List[ExternalInput] = []
    for name, tensor in audit_candidates(runner, registry).items():
        if runs.failed is not None:
            break
        progress(f"audit: {name}")

        def poisoned(inner, step_runner, *args, tensor=tensor):
            scramble(tensor)
            return inner(step_runner, *args)

        tokens, error = runs.run(poisoned)
        if error is not None or tokens != clean:
            found.append(StaleInput(name, tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
    return found


class VllmVerify:
    """``graphslot verify``'s target for the plugin: stock vLLM's and the plugin's clean runs, the checks of the module
    doc, and the report; the plugin installed for them and restored after."""

    def __init__(self, llm: Any, label: str = "vLLM 0.32 plugin", spec: Optional[Path] = None):
        self.label = label
        self.spec = spec
        self.runs = WorkloadRuns(llm)

    def verify(self, samples: int = 2, seed: int = 0, audit: bool = True,
               progress: Optional[Callable[[str], None]] = None) -> VerifyReport:
        """The report (``samples`` and ``seed`` do not apply: every step of the workload is checked)."""
        was_installed = patching.installed()
        patching.uninstall()
        stock = generate(self.runs.llm)
        patching.install()
        runner_fill.use_spec(self.spec)
        try:
            return self.checked(stock, audit, progress or (lambda line: None))
        finally:
            runner_fill.use_spec(None)
            if not was_installed:
                patching.uninstall()

    def checked(self, stock: List[List[int]], audit: bool, progress: Callable[[str], None]) -> VerifyReport:
        runners: List[Any] = []
        clean, error = self.runs.run(lambda inner, runner, *args: runners.append(runner) or inner(runner, *args))
        if error is not None:
            raise RuntimeError(f"the workload fails with the plugin: {error}")
        problems = []
        again, _ = self.runs.run()
        if again != clean:
            problems.append("two clean runs give other tokens: the run is not deterministic")
        if clean != stock:
            problems.append(f"the tokens differ from stock vLLM's in requests {differing(clean, stock)}")
        runner = runners[0]
        registry = runner_fill.registry_of(runner)
        if registry is None:
            raise RuntimeError(f"the plugin handed {type(runner).__name__} back to vLLM's own _prepare_inputs (its "
                               "WARNING names why): there is no graphslot fill to verify")
        verdicts = [tail_verdict(self.runs, slot, clean, progress) for slot in registry.active]
        stale = stale_inputs(self.runs, runner, registry, clean, progress) if audit else []
        if self.runs.failed is not None:
            problems.append(f"a poisoned run failed ({self.runs.failed}); the engine does not run again after a "
                            "failed step, so the checks after it were not run")
        summary = (f"{len(runners)} steps of {len(clean)} requests, each run with the plugin "
                   f"(spec {runner_fill.spec_path().name}); tokens compared request by request; vLLM on "
                   f"{runner.device}, no graphs")
        return VerifyReport(self.label, f"vLLM {runner.device}", [], verdicts, stale, problems, summary=summary)


def target() -> VllmVerify:
    """``graphslot verify graphslot.integrations.vllm.verify:target``: the shipped spec on the tiny Llama's engine
    (built into a temporary directory)."""
    in_process_engine_env()  # before vLLM is imported: its log on stderr, the engine in this process
    model_dir = Path(tempfile.mkdtemp(prefix="graphslot-vllm-verify-"))
    return VllmVerify(tiny_engine(model_dir), label="graphslot.integrations.vllm (vllm.yaml, the tiny Llama)")


__all__ = ["DECLARED_STATE", "StaleInput", "VllmVerify", "WorkloadRuns", "target"]
