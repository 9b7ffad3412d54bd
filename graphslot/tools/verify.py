"""``graphslot verify``: prove, per model, that its spec's padding is safe.

Of a decode or a prefill runner (``runner.verify_sizes``: batch sizes, or token
buckets): for each captured size and a sample of raw sizes that pad to it, one real batch is
replayed several times from the same state: twice clean (the replay must be
deterministic), then, one slot at a time, with the padded tail of every slot whose
policy leaves the tail untouched poisoned with two patterns (:mod:`.poison`). The raw
rows of the output must be bit-identical to the clean run under both; a difference
names the slot, the rows its tail leaks into, and the policy that makes it safe.
Poisoning one slot at a time is what lets the report name it. The stale-input audit
(:mod:`.audit`) runs too. Backend-agnostic: the same replays run on the CPU tape and
on CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..runners.contract import statics
from ..runners.phase import PhaseRunner
from ..spec.errors import shorten
from ..spec.files import display_path
from .audit import audit_external_inputs
from .poison import PATTERNS, Poisoner, hostile_name, poisonable
from .verify_report import SlotVerdict, VerifyReport
from .verify_report import format_report as format_report  # the report's printer, importable here as before

_IMPORTLIB = Path(importlib.__file__).parent
_PACKAGE = Path(__file__).resolve().parent.parent


class TargetError(ValueError):
    """The target, not the model's spec, is at fault: it cannot be imported, it raises,
    or its ``make_batch(n)`` does not make a batch of ``n`` requests. The message says
    what, without naming the target (the caller knows it)."""


def describe_exception(exc: BaseException) -> str:
    """``file:line: Type: message`` of ``exc`` caught where it was, one short line: the
    line of a SyntaxError, else of the innermost frame below the catching one that is
    not the import machinery's, nor graphslot's when the target's code called it (the
    target's line that called graphslot wrongly; none: ``Type: message``)."""
    if isinstance(exc, SyntaxError):
        where = exc.filename
        line = exc.lineno
        message = exc.msg
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:]
                  if not (f.filename.startswith("<frozen") or Path(f.filename).parent == _IMPORTLIB)]
        theirs = [f for f in frames if not Path(f.filename).resolve().is_relative_to(_PACKAGE)]
        frames = theirs or frames
        where, line = (frames[-1].filename, frames[-1].lineno) if frames else (None, None)
        message = str(exc).splitlines()[0] if str(exc).strip() else ""
    if where and not where.startswith("<"):
        where = display_path(Path(where))
    prefix = f"{where}:{line}: " if where and line else ""
    text = f"{prefix}{type(exc).__name__}" + (f": {message}" if message else "")
    return shorten(text, 300, quote=False)


@dataclass
class VerifyTarget:
    """What verify runs: a phase runner (decode or prefill) and real batches for it.

    ``make_batch(n)`` returns a graph-runnable batch of size ``n`` in the runner's unit
    (``runner.size_unit``: a decode batch of ``n`` requests, a prefill batch of ``n``
    tokens), with real ids, lengths and KV slots; ``release(batch)``, if given, frees
    what it took.
    """

    runner: Any
    make_batch: Callable[[int], Any]
    release: Optional[Callable[[Any], None]] = None
    label: str = ""


def sample_raw_sizes(captured: Sequence[int], samples: int, seed: int) -> List[Tuple[int, int]]:
    """(raw, padded) cases: per captured size the smallest raw size padding to it (the
    longest tail) and up to ``samples - 1`` more at random; sizes with no tail are skipped."""
    rng = random.Random(seed)
    cases = []
    below = 0
    for bs in sorted(captured):
        raws = list(range(below + 1, bs))
        below = bs
        if raws:
            picked = [raws[0]] + sorted(rng.sample(raws[1:], min(samples - 1, len(raws) - 1)))
            cases += [(raw, bs) for raw in picked]
    return cases


def _tensors(x: Any) -> List[torch.Tensor]:
    """The tensors of an output: tensors, tuples, lists, mappings, dataclasses of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif isinstance(x, Mapping):
        items = list(x.values())
    elif isinstance(x, (list, tuple)):
        items = list(x)
    else:
        return []
    return [t for item in items for t in _tensors(item)]


def differing_rows(a: List[torch.Tensor], b: List[torch.Tensor]) -> List[int]:
    """Rows (dim 0) where any output tensor differs bit for bit (NaN equals NaN)."""
    rows: set = set()
    for x, y in zip(a, b):
        ne = x != y
        if x.is_floating_point():
            ne &= ~(x.isnan() & y.isnan())
        if ne.dim() == 0:
            ne = ne.reshape(1)
        rows.update(ne.reshape(ne.shape[0], -1).any(1).nonzero().flatten().tolist())
    return sorted(rows)


def span(rows: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    parts = []
    start = None
    for i, r in enumerate(rows):
        start = r if start is None else start
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            parts.append(str(r) if start == r else f"{start}..{r}")
            start = None
    return ", ".join(parts)


FIX = ("use padding 'zero' (with index: true where it indexes a pool whose row 0 is a harmless dummy) or "
       "'fill_sentinel' with a pad_value the model treats as harmless, so that every step resets the tail")


class _State:
    """Clones of everything a replay may write (slot buffers, non-parameter statics: the
    pools, metadata and the models' buffers)."""

    def __init__(self, runner: Any):
        tensors = [s.buffer for s in runner.registry.active]
        tensors += [t for t in statics(runner.adapter) if not isinstance(t, torch.nn.Parameter)]
        self.saved = [(t, t.clone()) for t in tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.saved:
                t.copy_(saved)


class _AfterFill:
    """A :class:`~graphslot.runners.step.StepObserver` running ``fn(raw_bs, padded_bs)``."""

    def __init__(self, fn: Callable[[int, int], None]):
        self.after_fill = fn


def _replay(runner: PhaseRunner, fb: Any, state: _State,
            hook: Optional[Callable[[int, int], None]]) -> List[torch.Tensor]:
    """The raw rows' outputs of one replay of ``fb`` from ``state``, ``hook`` seeing the
    step after its fill; kept out of the runner's metrics (``count=False``)."""
    state.restore()
    observer = _AfterFill(hook) if hook is not None else None
    if observer is not None:
        runner.add_observer(observer)
    try:
        return [t.clone() for t in _tensors(runner.replay(fb, count=False))]
    finally:
        if observer is not None:
            runner.remove_observer(observer)


def verify_runner(target: VerifyTarget, samples: int = 2, seed: int = 0, audit: bool = True,
                  progress: Optional[Callable[[str], None]] = None) -> VerifyReport:
    """Verify ``target`` (see the module doc); the runner's state is left as it was."""
    runner = target.runner
    reg = runner.registry
    external = audit_external_inputs(runner) if audit else []
    slots = [s for s in reg.active if poisonable(s)]
    poisoner = Poisoner()
    problems = []
    leaks: Dict[str, List[Dict[str, Any]]] = {s.name: [] for s in slots}
    exercised: Dict[str, int] = {s.name: 0 for s in slots}
    cases = sample_raw_sizes(runner.verify_sizes, samples, seed)
    done: List[Tuple[int, int]] = []
    for raw, padded in cases:
        try:
            fb = target.make_batch(raw)
        except Exception as exc:  # noqa: BLE001 - the target's code: report it, with where it failed
            raise TargetError(f"make_batch({raw}) raised ({describe_exception(exc)})") from exc
        try:
            _check_batch_size(runner, fb, raw)
            if not runner.can_run(fb) or runner.padded_size(fb) != padded:
                problems.append(f"make_batch({raw}) gave a batch that does not replay at size {padded}")
                continue
            if progress:
                progress(f"raw {raw} -> padded {padded}")
            done.append((raw, padded))
            state = _State(runner)
            live = [s for s in slots if s.resolved.structured or not s.resolved.plain_copy
                    or getattr(fb, s.name, None) is not None]

            def observe(raw_bs: int, padded_bs: int) -> None:
                for s in live:
                    poisoner.observe(s, _raw_rows(runner, s))

            clean = _replay(runner, fb, state, observe)
            counts = {s.name: _raw_rows(runner, s) for s in live}
            if differing_rows(clean, _replay(runner, fb, state, None)):
                problems.append(f"two clean replays of raw {raw} -> padded {padded} differ: the replay is not "
                                "deterministic, so a poisoned tail cannot be told from noise")
                continue
            for s in live:
                exercised[s.name] += 1
                for pattern in PATTERNS:
                    leak = _poisoned_leak(runner, fb, state, s, counts[s.name], pattern, poisoner, clean)
                    if leak:
                        leaks[s.name].append({"raw_bs": raw, "padded_bs": padded, **leak})
            state.restore()
        finally:
            if target.release is not None:
                target.release(fb)
    verdicts = [_verdict(s, slots, leaks, exercised) for s in reg.active]
    return VerifyReport(target.label, runner.backend.name, done, verdicts, external, problems)


def _raw_rows(runner: Any, slot: Any) -> int:
    """``slot``'s real rows in the step the runner filled last."""
    shape = runner.last_fill
    return slot.count(shape.raw_bs, shape.raw_tokens)


def _check_batch_size(runner: Any, fb: Any, raw: int) -> None:
    """TargetError unless ``fb``, what ``make_batch(raw)`` returned, is of size ``raw``
    (``runner.size_unit``: requests, or a prefill's tokens): a batch of another size
    would be verified as if it had ``raw`` (real rows poisoned as tail, reported as a
    leak of the spec)."""
    unit = runner.size_unit
    try:
        got = runner.step_size(fb)
    except Exception as exc:  # noqa: BLE001 - not a batch the runner can read
        raise TargetError(f"make_batch({raw}) returned {type(fb).__name__}, which the runner cannot read as a "
                          f"batch ({describe_exception(exc)})") from exc
    if got != raw:
        raise TargetError(f"make_batch({raw}) returned a batch of {got} {unit}; make_batch(n) must make a "
                          f"batch of exactly n {unit}")


def _poisoned_leak(runner, fb, state, slot, raw_rows, pattern, poisoner, clean) -> Optional[Dict[str, Any]]:
    def poison(raw_bs: int, padded_bs: int) -> None:
        shape = runner.last_fill
        poisoner.write(slot, raw_rows, slot.count(shape.padded_bs, shape.padded_tokens), pattern)

    name = pattern if pattern == "stale" else hostile_name(slot.buffer.dtype)
    try:
        rows = differing_rows(clean, _replay(runner, fb, state, poison))
    except Exception as exc:  # noqa: BLE001 - a poisoned tail that crashes the replay is the finding
        return {"pattern": name, "rows": [], "error": f"{type(exc).__name__}: {shorten(str(exc), 200, quote=False)}"}
    return {"pattern": name, "rows": rows} if rows else None


def _verdict(slot, poisoned, leaks, exercised) -> SlotVerdict:
    spec = slot.resolved
    name = slot.name
    if not spec.axis.sliced:
        return SlotVerdict(name, spec.padding, "n/a", "not sliced by the step: no padded rows")
    if spec.resets_tail:
        return SlotVerdict(name, spec.padding, "safe", f"tail reset to {spec.tail_value!r} every step")
    if spec.repeats_last:
        return SlotVerdict(name, spec.padding, "safe", "tail set to the head's last row every step")
    found = leaks.get(name, [])
    if found:
        first = found[0]
        rows = sorted({r for leak in found for r in leak["rows"]})
        what = (f"the replay fails with the tail poisoned ({first['error']})" if first.get("error") else
                f"the tail leaks into real rows {span(rows)}")
        cases = sorted({f"{leak['raw_bs']}->{leak['padded_bs']}" for leak in found})
        detail = f"{what} ({len(found)} poisoned replay(s) differ, raw->padded {', '.join(cases)}); {FIX}"
        return SlotVerdict(name, spec.padding, "UNSAFE", detail, found)
    if not exercised.get(name):
        return SlotVerdict(name, spec.padding, "unverified", "no sampled step had padded rows with this slot set")
    patterns = f"stale, {hostile_name(slot.buffer.dtype)}"
    return SlotVerdict(name, spec.padding, "safe", f"tail poisoned ({patterns}) in {exercised[name]} step(s): "
                       "raw rows bit-identical to the clean replay")
