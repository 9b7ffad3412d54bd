"""Data-parallel decode: every rank agrees on one padded size and one graph, or on eager,
and an error on any rank is raised on every rank instead of hanging the others.

With DP attention the captured graph holds a collective (the gather of every rank's
tokens), so a step only completes when every rank runs the same collective on the same
sizes. The classic failures are ranks picking different padded sizes or graphs, one
rank falling back to eager while the others replay, and per-rank counts that go stale
-- each a hang or silent garbage. :class:`DPDecodeRunner` rules them out by deciding
only from what every rank holds alike:

1. before each step, one small all-gather exchanges each rank's token count (the
   engine's ``global_num_tokens_cpu``, written onto the batch fresh every step), a
   "can run a graph" flag (false for a batch that is not graph-runnable, a prefill say)
   and, with context buckets, its longest context (``DecodeAdapter.context_len``);
2. every rank then computes the same answer: the smallest captured size that fits the
   busiest rank (and the smallest context bucket that holds the longest context of any
   rank), or eager on every rank when any flag is false or the busiest rank is beyond
   the largest graph (or the longest context beyond the largest bucket);
3. eager runs the same collectives (each rank padded to the busiest, sglang's
   ``MAX_LEN`` mode), so ranks stay matched either way. A rank with no requests runs
   an empty batch, joining the collectives; a step where no rank has any is skipped.

Before capture (which runs the collectives too) the ranks agree, in one
``all_gather_object``, on everything that shapes the graphs or the per-step exchange:
the captured sizes, the context buckets, ``lazy``, ``num_tokens_per_bs``,
``disable_padding``, the warm-up runs before each capture, the graph backend, the slot
spec (name and hash) and the spec params its buffers read (shapes, dtypes by name,
``enabled_if``). A disagreement is a
:class:`~graphslot.SlotError` on every rank naming each setting and every rank's value;
a rank that failed to build its runner fails every rank (:class:`DPStepError`), all
before any capture. (``share_outputs`` and the registry mode stay per rank: they change
no collective.)

Fail fast, never hang. A rank that raises while its peers are inside a collective leaves
them hung (NCCL) or aborted (gloo), and a rank that catches such an error and carries on
runs its next step's collectives against their current ones. So a step runs in four
phases, every host step that can raise coming before the forward's collectives:

- *exchange*: the counts and flags above, plus whether this rank failed computing them;
- *prepare*: the pad decision, the fill, extract, the replay metadata, the replay guard
  (:meth:`DecodeGraphRunner.prepare`), or for eager the gather's size;
- *ok*: one more all-gather, of one int per rank: did prepare raise;
- *launch*: if every rank is ok, every rank replays (or runs eager); else every rank
  raises :class:`DPStepError` naming the failing rank(s) and each one's own error (the
  messages are gathered only then). The happy path pays one more tiny fixed-size
  collective a step, as much as the exchange itself (over gloo a localhost round trip;
  on NCCL a kernel launch and a device-to-host read): the price of never entering the
  forward's collectives with a peer that will not.

After a :class:`DPStepError` no rank ran the step's forward and every rank's runner is
ready for the next step: all ranks may go on with their next step (the failed step's
batches ran nowhere; the engine retries or drops them) or all stop. Both are consistent;
what is not is some going on while others stop: those wait in the next exchange for
ranks that never come (a launcher's timeout ends that). What raises inside the forward
itself (model code between its collectives, a lazy capture) is past this point: the
peers are in the collectives already.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..spec.dtypes import dtype_name, is_torch_dtype
from ..spec.errors import SlotError, shorten
from ..spec.expr import Expr
from ..spec.model import RegistrySpec
from .adapter import DecodeAdapter
from .config import runner_config
from .decode import DecodeGraphRunner, DecodeRunnerConfig

#: Characters of one rank's error message sent to its peers.
MAX_ERROR_CHARS = 2000


def _all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, else the old
    gather(out, mine, group=group)


def describe_error(exc: BaseException) -> Tuple[str, str]:
    """``(type name, message)`` of an error, the message bounded: what a rank tells its peers."""
    return type(exc).__name__, shorten(str(exc), MAX_ERROR_CHARS, quote=False)


class DPStepError(SlotError):
    """Raised on every DP rank, with the same message, when any rank failed where the
    others cannot go on without it. ``failures``: each failing rank's (error type,
    message); ``rank``: the rank that raised this one."""

    def __init__(self, failures: Mapping[int, Tuple[str, str]], rank: int, where: str, after: str = ""):
        self.failures, self.rank, self._args = dict(sorted(failures.items())), rank, (where, after)
        if len(self.failures) == 1:
            (culprit, (kind, message)), = self.failures.items()
            what = f"DP rank {culprit} failed {where}: {kind}: {message}"
        else:
            what = (f"DP ranks {', '.join(map(str, self.failures))} failed {where} ("
                    + "; ".join(f"rank {r}: {kind}: {message}" for r, (kind, message) in self.failures.items()) + ")")
        super().__init__(f"{what}; every rank raised this error{after}")

    def __reduce__(self) -> Any:
        return type(self), (self.failures, self.rank, *self._args)

    @property
    def failed_ranks(self) -> List[int]:
        return list(self.failures)


class DPExchange:
    """The collectives of a DP step over a process group: the per-step exchange of token
    counts and flags, and the settling of failures."""

    def __init__(self, group: Optional[Any] = None, device: torch.device | str = "cpu"):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = torch.device(device)

    def __call__(self, num_tokens: int, can_run: bool, failed: bool = False, longest: int = 0
                 ) -> Tuple[List[int], List[bool], List[bool], List[int]]:
        """Every rank's token count, can-run flag, failed flag and longest context."""
        rows = self._gather_ints([num_tokens, int(can_run), int(failed), longest])
        return ([row[0] for row in rows], [bool(row[1]) for row in rows], [bool(row[2]) for row in rows],
                [row[3] for row in rows])

    def failed(self, mine: bool) -> List[bool]:
        """Every rank's failed flag: one int a rank."""
        return [bool(row[0]) for row in self._gather_ints([int(mine)])]

    def _gather_ints(self, mine: List[int]) -> List[List[int]]:
        everyone = torch.empty(len(mine) * self.size, dtype=torch.int64, device=self.device)
        _all_gather_into(everyone, torch.tensor(mine, dtype=torch.int64, device=self.device), self.group)
        return everyone.view(self.size, len(mine)).tolist()

    def gather_objects(self, mine: Any) -> List[Any]:
        """Every rank's picklable object (``all_gather_object``: for rare or one-off use)."""
        values: List[Any] = [None] * self.size
        dist.all_gather_object(values, mine, group=self.group)
        return values

    def settle(self, error: Optional[BaseException], failed: List[bool], where: str, after: str = "") -> None:
        """When any rank failed, raise :class:`DPStepError` on every rank (this rank's
        ``error`` chained), after gathering the failing ranks' messages."""
        if not any(failed):
            return
        told = self.gather_objects(None if error is None else describe_error(error))
        failures = {r: told[r] or ("Error", "(no message)") for r, bad in enumerate(failed) if bad}
        raise DPStepError(failures, self.rank, where, after) from error


def buffer_params(spec: RegistrySpec) -> List[str]:
    """The spec params a slot buffer's shape, dtype or presence (``enabled_if``) reads."""
    names = set()
    for slot in spec.slots:
        for value in (*slot.shape, slot.enabled_if):
            if isinstance(value, str):
                names |= Expr.parse(value).names
        names.add(slot.dtype)
    return [name for name in spec.params if name in names]


def runner_settings(runner: DecodeGraphRunner) -> Dict[str, Any]:
    """What DP ranks must hold alike before capture, by the name an error shows."""
    config, registry = runner.config, runner.registry
    spec = registry.spec
    settings: Dict[str, Any] = {
        "the captured sizes": list(runner.captured_sizes), "the context buckets": runner.captured_contexts,
        "lazy": config.lazy, "num_tokens_per_bs": runner.k,
        "disable_padding": config.disable_padding, "warmup": config.warmup, "warmup_sizes": config.warmup_sizes,
        "the graph backend": runner.backend.name, "the slot spec": f"{spec.name} (identity {spec.identity[:12]})",
    }
    for name in buffer_params(spec):
        value = registry.params[name]
        settings[f"spec param {name}"] = dtype_name(value) if is_torch_dtype(value) else value
    return settings


def disagreements(settings: List[Dict[str, Any]]) -> List[str]:
    """``setting (rank 0: value, rank 1: value)`` for each setting not the same on every rank."""
    out = []
    for key in dict.fromkeys(k for rank in settings for k in rank):
        values = [rank.get(key, "(not set)") for rank in settings]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {shorten(v, 200, quote=False)}" for r, v in enumerate(values))
            out.append(f"{key} ({shown})")
    return out


@dataclass(frozen=True)
class DPStep:
    """What the ranks agreed on for one step (the same on every rank)."""

    global_num_tokens: List[int]
    can_run: List[bool]
    #: The graph every rank replays, or None: every rank runs eager.
    padded_bs: Optional[int]
    #: Every rank's longest context (all 0 without context buckets).
    contexts: List[int] = dataclasses.field(default_factory=list)
    #: The context bucket every rank replays; None without buckets or when eager.
    context: Optional[int] = None

    @property
    def idle(self) -> bool:
        """No rank has a token: the step is skipped everywhere."""
        return max(self.global_num_tokens) == 0


class DPDecodeRunner:
    """Builds the rank's :class:`DecodeGraphRunner` (every rank in step: capture runs the
    collectives); then call it once per step on every rank, with the rank's batch or
    None when the rank has no requests."""

    def __init__(self, adapter: DecodeAdapter, exchange: DPExchange, config: Optional[DecodeRunnerConfig] = None,
                 **overrides: Any):
        config = runner_config(DecodeRunnerConfig, config, overrides)
        try:  # everything local first: a rank failing here must not leave the others in a capture
            self._check_dp_params(adapter, config, exchange.size)
            runner = DecodeGraphRunner(adapter, config, defer_capture=True)
            mine, error = runner_settings(runner), None
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            mine, error = None, exc
        told = exchange.gather_objects(mine if error is None else describe_error(error))
        failures = {rank: t for rank, t in enumerate(told) if isinstance(t, tuple)}
        if failures:
            raise DPStepError(failures, exchange.rank, "building its runner", ", before any capture") from error
        differ = disagreements(told)
        if differ:
            raise SlotError(f"DP ranks disagree on {'; '.join(differ)}: every rank must build its runner alike "
                            "(captured sizes, settings, slot spec and buffer params), or their captures and steps "
                            "run different collectives, which hang or abort; nothing was captured")
        if not config.lazy:
            runner.capture_all()
        self.runner, self.exchange = runner, exchange
        self.adapter, self.k = adapter, runner.k
        self.last: Optional[DPStep] = None
        self.steps = self.graph_steps = self.eager_steps = self.skipped_steps = 0

    @staticmethod
    def _check_dp_params(adapter: DecodeAdapter, config: DecodeRunnerConfig, size: int) -> None:
        params = {**adapter.spec_params(), **config.params}
        dp = {name: params.get(name) for name in ("require_gathered_buffer", "require_mlp_tp_gather", "dp_size")}
        if dp != {"require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": size}:
            raise ValueError(f"DP decode needs the decode spec params require_gathered_buffer=True, "
                             f"require_mlp_tp_gather=True and dp_size={size} (the group's size) from the "
                             f"adapter's spec_params or the runner config; they are {dp}")

    def locally_runnable(self, fb: Any) -> bool:
        """This rank's say: a graph can run its batch, given a size that fits."""
        return fb is None or self.adapter.tokens_per_bs(fb) == self.k

    def agree(self, counts: List[int], flags: List[bool], longest: int = 0) -> Optional[int]:
        """The padded size every rank picks from the same counts, flags and longest context
        (of any rank); None: eager (or, with no tokens anywhere, nothing)."""
        dispatch = self.runner.dispatch
        needed = dispatch.rows_for_tokens(max(counts))
        if not all(flags) or needed < 1 or dispatch.size_problem(needed) or dispatch.context_problem(longest):
            return None
        return dispatch.pad(needed)

    def _longest(self, fb: Any, runnable: bool) -> int:
        """This rank's longest context, for the exchange (0: no buckets, no batch or no graph)."""
        return self.adapter.context_len(fb) if self.runner.bucketed and runnable and fb is not None else 0

    def __call__(self, fb: Any) -> Optional[Any]:
        """This rank's outputs (its rows only), or None when idle or when every rank is.
        Raises :class:`DPStepError` on every rank when any rank failed before the forward."""
        self.steps += 1
        where = f"at DP step {self.steps}"
        after = ", and no rank ran this step: all may go on with their next step, or all stop"
        try:
            num_tokens, runnable, error = (0 if fb is None else self.adapter.num_tokens(fb)), \
                self.locally_runnable(fb), None
            longest = self._longest(fb, runnable)
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            num_tokens, runnable, longest, error = 0, False, 0, exc
        counts, flags, failed, contexts = self.exchange(num_tokens, runnable, error is not None, longest)
        self.exchange.settle(error, failed, f"{where}, before the exchange", after)
        padded = self.agree(counts, flags, max(contexts))
        context = None if padded is None else self.runner.dispatch.pad_context(max(contexts))
        step = self.last = DPStep(counts, flags, padded, contexts, context)
        if step.idle:
            self.skipped_steps += 1
            return None
        if step.padded_bs is not None:  # lazy: every rank captures at this step, before anything can fail
            self.runner.graph(step.padded_bs, step.context)
        try:
            run, error = self._prepare(fb, step), None
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            run, error = None, exc
        self.exchange.settle(error, self.exchange.failed(error is not None), f"{where}, preparing its batch", after)
        return run()

    def _prepare(self, fb: Any, step: DPStep) -> Callable[[], Optional[Any]]:
        """Every host step before the forward's collectives; the forward, to run."""
        counts = step.global_num_tokens
        batch = self.adapter.make_dummy_batch(1, self.k) if fb is None else fb
        batch.global_num_tokens_cpu = counts  # fresh every step: never a stale count
        if step.padded_bs is not None:
            prepared = self.runner.prepare(batch, count=fb is not None, longest=max(step.contexts))
            if (prepared.bs, prepared.context) != (step.padded_bs, step.context):  # the same inputs; never differs
                raise RuntimeError(f"DP rank {self.exchange.rank}: the runner pads to {prepared.bs} (context "
                                   f"{prepared.context}), the ranks agreed on {step.padded_bs} (context "
                                   f"{step.context})")
            return functools.partial(self._replay, prepared, fb is not None)
        reason = None
        if fb is not None:  # in the runner's metrics and histogram, as a fallback of its own would be
            reason = (self.runner.eager_reason(batch) or self.runner.dispatch.context_problem(max(step.contexts))
                      or "another DP rank cannot run a graph")
        rows = max(counts)
        self.adapter.set_dp_buffer_len([rows] * len(counts), rows * len(counts))
        needed = self.runner.dispatch.rows_for_tokens(rows) if all(step.can_run) else None
        return functools.partial(self._eager, batch, reason, needed)

    def _replay(self, prepared: Any, real: bool) -> Optional[Any]:
        self.graph_steps += 1
        out = self.runner.launch(prepared)
        return out if real else None

    def _eager(self, batch: Any, reason: Optional[str], needed: Optional[int]) -> Optional[Any]:
        """``reason`` None: this rank has no requests (``batch`` is a dummy)."""
        self.eager_steps += 1
        if reason is not None:
            self.runner.record_eager(reason, needed)
        out = self.adapter.forward_eager(batch)
        return None if reason is None else out
