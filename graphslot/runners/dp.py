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
   "can run a graph" flag (false for a batch that is not graph-runnable, a prefill say),
   with context buckets its longest context (``DecodeAdapter.context_len``), and
   whether its batch failed the checks made before the exchange (below);
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
``disable_padding``, the warm-up runs before each capture, the replay guard (it adds a
collective a step), the graph backend, the slot spec (name and hash) and the spec
params its buffers read (shapes, dtypes by name, ``enabled_if``). A disagreement is a
:class:`~graphslot.SlotError` on every rank naming each setting and every rank's value;
a rank that failed to build its runner fails every rank (:class:`DPStepError`), all
before any capture. (``share_outputs`` and the registry mode stay per rank: they change
no collective.)

Fail fast, never hang. A rank that raises while its peers are inside a collective leaves
them hung (NCCL) or aborted (gloo), and a rank that catches such an error and carries on
runs its next step's collectives against their current ones. So a step runs in three
phases, and everything of the runner's own that can fail comes before its one collective:

- *check*: the rank reads its batch (token count, can-run flag, longest context) and,
  when a graph may run it (its rows within the largest captured size), checks that
  every fill it could get fits: the requests times ``num_tokens_per_bs`` are its tokens,
  and its batch fields fit the slot spec at its raw counts
  (:meth:`SlotRegistry.check_step <graphslot.registry.base.SlotRegistry.check_step>`:
  the fill's own checks, none of which depends on the padded size); a batch no graph
  runs gets its eager reason; an idle rank makes and checks its dummy batch. Nothing is
  written but a fresh ``global_num_tokens_cpu`` list on the batch.
- *exchange*: the one all-gather of a steady step, six ints a rank: the call and
  lifecycle generation (below), the counts and flags above and whether the check
  raised. When any rank's did, every rank raises
  :class:`DPStepError` naming the failing rank(s) and each one's own error (the
  messages are gathered only then, in a second collective off the steady path).
- *run*: every rank computes the same answer, fills the batch's
  ``global_num_tokens_cpu`` in place, then replays (a lazy capture first, if the key is
  new; then :meth:`DecodeGraphRunner.stage`: the fill, extract, the replay metadata;
  then the replay) or runs eager (the gather's size, the eager forward).

On a checked batch the run phase has nothing of the runner's own left to fail: the
agreed size is a captured one holding the busiest rank's rows (so ``raw <= padded <=
capacity``), the bucket holds the longest context of any rank, and the fields were
checked at the counts the fill uses. What can still raise there is code the engine
supplies, run on the agreed step: the spec's ``source`` and ``post_fill`` hooks (a
source hook's result is checked where it is made), the adapter's
``set_context_bucket``, ``init_replay_metadata``, ``set_dp_buffer_len`` and forward,
the runner's observers, a lazy capture (which runs the forward and its collectives).
An error there is a bug in that code and is treated as one inside the forward: the
peers are committed to the step and wait in its collectives until the group's timeout
(NCCL) or abort when the failing rank's process ends (gloo); a launcher with a deadline
(:func:`graphslot.reference.dp_launch.launch`) names the rank. sglang and vLLM do the
same: one collective a step, whatever comes after it fails as the forward does.
Debugging: with the replay guard on (``GRAPHSLOT_DEBUG=1`` or ``guard=True``; the ranks
agree on it before capture) each step pays a second all-gather after prepare -- did it
raise -- so that what the guard finds (a tensor moved since capture), or a hook's error,
raises :class:`DPStepError` on every rank before any forward instead.

After a :class:`DPStepError` no rank ran the step's forward and every rank's runner is
ready for the next step: all ranks may go on with their next step (the failed step's
batches ran nowhere; the engine retries or drops them) or all stop. Both are consistent;
what is not is some going on while others stop: those wait in the next exchange for
ranks that never come (a launcher's timeout ends that).

Lifecycle: :meth:`DPDecodeRunner.release` and :meth:`DPDecodeRunner.recapture` are
collective calls, which every rank makes between the same two steps (the rank's own
``runner.release()`` and ``recapture()`` refuse). Each is an exchange of a step's shape
whose first two ints, in a step's too, say what the rank calls and its lifecycle
generation: ranks that differ raise :class:`DPStepError` on every rank naming the odd
one(s), before any releases, captures or steps; a steady step stays at one collective.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from ..spec.dtypes import dtype_name, is_torch_dtype
from ..spec.errors import SlotError, shorten
from ..spec.expr import Expr
from ..spec.model import RegistrySpec
from .adapter import DecodeAdapter
from .config import runner_config
from .contract import hook_count
from .decode import DecodeGraphRunner, DecodeRunnerConfig
from .dp_exchange import CALLS, DPExchange, DPStepError, describe_error
from .guard import guard_wanted

#: The end of a step's DPStepError: what the ranks may do next.
AFTER_A_STEP_ERROR = ", and no rank ran this step: all may go on with their next step, or all stop"


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
    config = runner.config
    registry = runner.registry
    spec = registry.spec
    settings: Dict[str, Any] = {
        "the captured sizes": list(runner.captured_sizes), "the context buckets": runner.captured_contexts,
        "lazy": config.lazy, "num_tokens_per_bs": runner.k,
        "disable_padding": config.disable_padding, "warmup": config.warmup, "warmup_sizes": config.warmup_sizes,
        "the replay guard": guard_wanted(config.guard),
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


class _Checked(NamedTuple):
    """One rank's batch once checked, before the exchange."""

    #: The rank's batch, or an idle rank's dummy batch.
    batch: Any
    #: The batch's ``global_num_tokens_cpu``: filled in place with the exchanged counts.
    counts: List[int]
    num_tokens: int
    runnable: bool
    #: The longest context, for the exchange and the stage (0: no buckets, no batch or no graph).
    longest: int
    #: Why no graph runs the batch (``runnable`` false), for the metrics.
    reason: Optional[str]


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
            mine = runner_settings(runner)
            error = None
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            mine = None
            error = exc
        told = exchange.gather_objects(mine if error is None else describe_error(error))
        failures = {rank: t for rank, t in enumerate(told) if isinstance(t, tuple)}
        if failures:
            raise DPStepError(failures, exchange.rank, "building its runner", ", before any capture") from error
        differ = disagreements(told)
        if differ:
            raise SlotError(f"DP ranks disagree on {'; '.join(differ)}: every rank must build its runner alike "
                            "(captured sizes, settings, slot spec and buffer params), or their captures and steps "
                            "run different collectives, which hang or abort; nothing was captured")
        runner.lifecycle_owner = ("its DPDecodeRunner owns it, whose ranks release and recapture together: call "
                                  "release() or recapture() on the DPDecodeRunner, on every rank between the same "
                                  "two steps")
        if not config.lazy:
            runner.capture_all()
        self.runner = runner
        self.exchange = exchange
        self.adapter = adapter
        self.k = runner.k
        #: A second all-gather a step, after prepare (the replay guard is on: debugging).
        self.confirm = guard_wanted(config.guard)
        self.last: Optional[DPStep] = None
        self.steps = 0
        self.graph_steps = 0
        self.eager_steps = 0
        self.skipped_steps = 0

    @staticmethod
    def _check_dp_params(adapter: DecodeAdapter, config: DecodeRunnerConfig, size: int) -> None:
        params = {**adapter.spec_params(), **config.params}
        dp = {name: params.get(name) for name in ("require_gathered_buffer", "require_mlp_tp_gather", "dp_size")}
        if dp != {"require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": size}:
            raise ValueError(f"DP decode needs the decode spec params require_gathered_buffer=True, "
                             f"require_mlp_tp_gather=True and dp_size={size} (the group's size) from the "
                             f"adapter's spec_params or the runner config; they are {dp}")

    def locally_runnable(self, fb: Any) -> bool:
        """This rank's say: a graph can run its batch, given a size that fits (none after ``runner.release()``)."""
        return not self.runner.released and (fb is None or self.adapter.tokens_per_bs(fb) == self.k)

    def agree(self, counts: List[int], flags: List[bool], longest: int = 0) -> Optional[int]:
        """The padded size every rank picks from the same counts, flags and longest context
        (of any rank); None: eager (or, with no tokens anywhere, nothing)."""
        dispatch = self.runner.dispatch
        needed = dispatch.rows_for_tokens(max(counts))
        if not all(flags) or needed < 1 or dispatch.size_problem(needed) or dispatch.context_problem(longest):
            return None
        return dispatch.pad(needed)

    # -- lifecycle -------------------------------------------------------------------
    def release(self) -> None:
        """``runner.release()`` on every rank: a collective call (see the module's doc)."""
        self._agree_on("release()")
        self.runner.release_graphs()

    def recapture(self) -> None:
        """``runner.recapture()`` on every rank: a collective call (see the module's doc)."""
        self._agree_on("recapture()")
        self.runner.recapture_graphs()

    def _agree_on(self, call: str) -> None:
        self.runner.check_lifecycle_call(call, owner=True)  # in a step: this rank's error alone, as a hook's
        self.exchange(0, False, call=CALLS.index(call), generation=self.runner.generation)

    # -- steps -----------------------------------------------------------------------
    def __call__(self, fb: Any) -> Optional[Any]:
        """This rank's outputs (its rows only), or None when idle or when every rank is.
        Raises :class:`DPStepError` on every rank when any rank's batch failed the checks
        before the exchange, or a rank called :meth:`release` or :meth:`recapture` instead."""
        self.runner.steps_in_progress += 1  # the whole step: a hook's release() or recapture() is refused
        try:
            return self._step(fb)
        finally:
            self.runner.steps_in_progress -= 1

    def _step(self, fb: Any) -> Optional[Any]:
        self.steps += 1
        where = f"at DP step {self.steps}"
        try:
            mine = self._check(fb)
            error = None
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            mine = None
            error = exc
        generation = self.runner.generation
        counts, flags, failed, contexts = (
            self.exchange(0, False, True, generation=generation) if mine is None else
            self.exchange(mine.num_tokens, mine.runnable, False, mine.longest, generation=generation))
        self.exchange.settle(error, failed, f"{where}, before the exchange", AFTER_A_STEP_ERROR)
        mine.counts[:] = counts  # the batch's global_num_tokens_cpu: fresh every step, never stale
        padded = self.agree(counts, flags, max(contexts))
        context = None if padded is None else self.runner.dispatch.pad_context(max(contexts))
        step = DPStep(counts, flags, padded, contexts, context)
        self.last = step
        if step.idle:
            self.skipped_steps += 1
            return None
        if step.padded_bs is not None:  # lazy: every rank captures at this step (the forward's collectives)
            self.runner.graph(step.padded_bs, step.context)
        if not self.confirm:
            return self._stage(mine, step, fb is not None)()
        try:  # debugging: a second all-gather, so that what prepare raises fails every rank before the forward
            run = self._stage(mine, step, fb is not None)
            error = None
        except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
            run = None
            error = exc
        self.exchange.settle(error, self.exchange.failed(error is not None), f"{where}, preparing its batch",
                             AFTER_A_STEP_ERROR)
        return run()

    def _check(self, fb: Any) -> _Checked:
        """Everything about this rank's batch that can fail, before the exchange: what it
        tells its peers and, when a graph may run it, that every fill it can get fits (so
        that after the exchange the runner's own steps cannot fail). Writes nothing but a
        fresh ``global_num_tokens_cpu`` list on the batch."""
        adapter = self.adapter
        k = self.k
        num_tokens = 0 if fb is None else hook_count(adapter, "num_tokens", fb, "the batch's tokens")
        runnable = self.locally_runnable(fb)
        reason = None if runnable or fb is None else self.runner.eager_reason(fb)  # no peer's count needed
        bucketed = self.runner.bucketed and runnable and fb is not None
        longest = hook_count(adapter, "context_len", fb, "the batch's longest context") if bucketed else 0
        batch = adapter.make_dummy_batch(1, k) if fb is None else fb
        if runnable and self.runner.dispatch.rows_for_tokens(num_tokens) <= self.runner.dispatch.largest:
            raw_bs = adapter.batch_size(batch)  # a graph may run it: padded between its rows and the largest
            if fb is not None and raw_bs * k != num_tokens:  # the graph is sized by tokens, the fill by requests
                raise SlotError(f"{type(adapter).__name__}.batch_size says the {type(fb).__name__} holds {raw_bs} "
                                f"request(s) of {k} token(s) each, but num_tokens says {num_tokens} token(s); the "
                                "ranks pick the graph from the tokens and the fill copies the requests: make the "
                                "two agree (batch_size, num_tokens, or the batch)")
            self.runner.registry.check_step(batch, raw_bs=raw_bs, raw_num_tokens=raw_bs * k)
        counts = [0] * self.exchange.size
        batch.global_num_tokens_cpu = counts
        return _Checked(batch, counts, num_tokens, runnable, longest, reason)

    def _stage(self, mine: _Checked, step: DPStep, real: bool) -> Callable[[], Optional[Any]]:
        """The host steps after the exchange (on a checked batch, none of the runner's own
        can fail); the forward, to run. ``real``: the batch is the rank's, not a dummy."""
        dispatch = self.runner.dispatch
        counts = step.global_num_tokens
        rows = max(counts)
        needed = dispatch.rows_for_tokens(rows)
        if step.padded_bs is not None:  # the size and bucket the ranks agreed on (_check made raw_bs * k our count)
            longest = mine.longest if real else None  # read by the check; a dummy's is not: stage reads it
            staged = self.runner.stage(mine.batch, needed=needed, context=step.context, longest=longest, count=real)
            return functools.partial(self._replay, staged, real)
        reason = None
        if real:  # in the runner's metrics and histogram, as a fallback of its own would be
            reason = (mine.reason or dispatch.size_problem(needed) or dispatch.context_problem(max(step.contexts))
                      or "another DP rank cannot run a graph")
        self.adapter.set_dp_buffer_len([rows] * len(counts), rows * len(counts))
        return functools.partial(self._eager, mine.batch, reason, needed if all(step.can_run) else None)

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
