"""The decode graph runner: one graph per captured batch size, inputs staged by slots.

Generic over model, batch type and attention backend through a
:class:`~graphslot.runners.adapter.DecodeAdapter`; the static inputs are the decode
spec's registry, so what is copied and how padded rows look is the spec's business,
not this module's. Which size a step replays, or why it runs eager, is the
:class:`~graphslot.runners.dispatch.SizeDispatcher`'s (``runner.dispatch``); this module
captures and replays.

Context buckets (``DecodeRunnerConfig.context_buckets``): a graph per ``(batch size,
context bucket)``, so a step's attention costs the bucket of its longest context rather
than the longest context the engine allows (the cost model is in
:mod:`~graphslot.runners.dispatch`). Without them (None, the default) graphs are keyed by
batch size alone, as they always were; with them ``runner.graphs`` is keyed by
``(bs, L)``, and :attr:`DecodeGraphRunner.graph_keys` lists both kinds as ``(bs, L or
None)`` pairs.

Capture modes (``capture="full" | "breakable" | "piecewise"``, :mod:`.capture`), the graph
pool, the engine's capture context and the lifecycle (``release()``, ``recapture()``) are
every phase runner's (:class:`~graphslot.runners.phase.PhaseRunner`).

Public capture API (what ``graphslot verify``'s audit and the runner use): ``capture_view``
stages a size's dummy batch, ``graph_body`` is what its graph runs, and ``capture_on``
captures the two on any graph backend (methods of :class:`DecodeGraphRunner`).

The step path both phases share (observers, the replay guard, metrics and the
histogram, the audit hooks of ``graphslot verify``) is
:class:`~graphslot.runners.step.StepPath`'s; this module keeps decode's own: its keys
(batch size, context bucket), their dispatch, its staging (``stage``, ``launch``), the
DP buffer sizes, shared outputs and its dummy batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..api import build
from ..graphs.backend import Graph, GraphBackend
from ..log import get_logger
from ..spec.errors import SlotError
from .adapter import DecodeAdapter
from .batch import check_batch_rows, check_dummy_batch, check_slice_output, describe_dummy
from .config import GraphRunnerConfig, registry_buffers, runner_config
from .contract import check_adapter
from .dispatch import SizeDispatcher, capture_sizes, context_ladder, other_forward_mode
from .outputs import SharedOutputs
from .phase import RELEASED, PhaseRunner
from .report import describe_sizes
from .step import FillShape, StepObserver

__all__ = ["DecodeGraphRunner", "DecodeRunnerConfig", "PreparedReplay", "StepObserver"]  # StepObserver: from .step

log = get_logger(__name__)


@dataclass
class DecodeRunnerConfig(GraphRunnerConfig):
    max_bs: int = 32
    #: The decode slot spec: a shipped name, a YAML path or a loaded RegistrySpec.
    spec: Any = "decode"
    #: Explicit sizes, or a :class:`~graphslot.planning.planner.Plan` (with ``max_bs=plan.max_bs``,
    #: or ``**plan.runner_kwargs()``); None takes :func:`~graphslot.planning.planner.default_capture_schedule`.
    capture_bs: Optional[Sequence[int]] = None
    capture_bs_multiple: Optional[int] = None
    #: > 1: speculative target-verify, k tokens per request.
    num_tokens_per_bs: int = 1
    #: Run only batches whose size was captured exactly.
    disable_padding: bool = False
    #: Every size's graph copies its output into one set of largest-size buffers
    #: (:class:`~graphslot.runners.outputs.SharedOutputs`): the graphs keep one output
    #: alive, not one per size, for one device copy per output tensor per replay; outputs
    #: are then valid until the next replay of any size. Not with ``capture="piecewise"``
    #: (the copy would run outside the pieces).
    share_outputs: bool = False
    #: Context buckets: None (one implicit bucket: graphs keyed by batch size, each
    #: serving every context); ``"auto"`` (128, 256, ... up to the adapter's
    #: ``max_context_len``); or the lengths. With buckets a graph is captured per
    #: ``(bs, L)`` and a step replays the smallest bucket holding its longest context
    #: (``DecodeAdapter.context_len``); a longer step runs eager. ``lazy=True`` keeps
    #: the capture time to the keys steps use.
    context_buckets: Union[None, str, Sequence[int]] = None


class PreparedReplay(NamedTuple):
    """A batch staged in its graph's buffers (:meth:`DecodeGraphRunner.stage`)."""

    graph: Any
    raw_bs: int
    #: The captured size replayed.
    bs: int
    #: The rows the step needed, for the metrics; None: not counted.
    needed: Optional[int]
    #: The context bucket replayed; None without buckets.
    context: Optional[int] = None
    #: The runner's :attr:`~graphslot.runners.phase.PhaseRunner.generation` when staged.
    generation: int = 0
    #: Which fill of the runner's buffers this step's is (:attr:`~graphslot.runners.phase.PhaseRunner.fills`).
    fill: int = 0


class DecodeGraphRunner(PhaseRunner):
    """Captures on construction (or, ``lazy``, each size -- or ``(size, bucket)`` -- when
    first needed); :meth:`replay` runs a batch :meth:`can_run` accepts."""

    phase = "decode"
    _log = log

    def __init__(self, adapter: DecodeAdapter, config: Optional[DecodeRunnerConfig] = None, *,
                 defer_capture: bool = False, **overrides: Any):
        """``defer_capture``: capture nothing yet, :meth:`capture_all` does (a DP runner
        agrees with its peers first: capture runs their collectives)."""
        config = runner_config(DecodeRunnerConfig, config, overrides)
        #: Where the registry's buffers and the graphs live: the adapter's ``device``, else its model's.
        self.device = check_adapter(adapter, DecodeAdapter, DecodeAdapter.REQUIRED_HOOKS)
        self.adapter = adapter
        self.config = config
        self.k = int(config.num_tokens_per_bs)
        #: Which captured size a step replays, or why it runs eager.
        self.dispatch = SizeDispatcher(
            capture_sizes(config.max_bs, config.capture_bs, config.capture_bs_multiple, adapter.max_requests),
            num_tokens_per_bs=self.k, disable_padding=config.disable_padding,
            contexts=context_ladder(config.context_buckets, adapter.max_context_len))
        self.bucketed = self.dispatch.contexts is not None
        max_bs = self.dispatch.largest
        self.registry = build(config.spec, max_bs=max_bs, max_num_tokens=max_bs * self.k, device=self.device,
                                       params={**adapter.spec_params(), **config.params}, impl=config.impl,
                                       max_bytes=config.max_bytes, **registry_buffers(config.buffers))
        p = self.registry.params
        self.gathered = bool(p.get("require_gathered_buffer"))
        self._dp_ranks = int(p.get("dp_size", 1)) if p.get("require_mlp_tp_gather") else 1
        self._init_graphs(config, adapter.split_ops)
        if config.share_outputs and self.capture_mode.name == "piecewise":
            raise ValueError("share_outputs=True needs capture='full' or 'breakable': under 'piecewise' the copy into "
                             "the shared outputs would run outside the captured pieces")
        #: What a graph runs: the adapter's forward, or (piecewise) it compiled to split at the split ops.
        self._forward = self.capture_mode.compile(adapter.forward)
        self._side = adapter.side_inputs()
        # Before any capture: what would otherwise fail in the first capture or step.
        check_dummy_batch(adapter, self.registry, adapter.make_dummy_batch(max_bs, max_bs * self.k),
                          ("batch_size", "num_tokens", "tokens_per_bs") + (("context_len",) if self.bucketed else ()),
                          "DecodeAdapter")
        check_slice_output(adapter)
        adapter.init_graph_state(max_bs, max_bs * self.k)
        self.shared_outputs = SharedOutputs(max_bs, max_bs * self.k) if config.share_outputs else None
        self._init_step_path(config.guard, log, num_tokens_per_bs=self.k, contexts=self.bucketed)
        self._eager_message = ("decode step ran eager: %s (%d rows needed; "
                               f"captured sizes {describe_sizes(self.dispatch.sizes)})")
        if not (config.lazy or defer_capture):
            self._capture_keys(self.graph_keys)

    @property
    def captured_sizes(self) -> List[int]:
        """The captured (lazy: capturable) batch sizes, largest first."""
        return self.dispatch.sizes

    @property
    def captured_contexts(self) -> Optional[List[int]]:
        """The context buckets, largest first; None without buckets."""
        return self.dispatch.contexts

    @property
    def graph_keys(self) -> List[Tuple[int, Optional[int]]]:
        """Every captured (lazy: capturable) ``(bs, context bucket or None)``, in capture order."""
        return self.dispatch.keys()

    # -- capture ---------------------------------------------------------------------
    def _capture_one(self, bs: int, context: Optional[int] = None) -> Graph:
        return self.capture_on(self.backend, bs, context=context, warmup=self._warmup())[0]

    def capture_on(self, backend: GraphBackend, bs: int, *, context: Optional[int] = None,
                   warmup: int = 0) -> Tuple[Graph, Any]:
        """Size ``bs`` (at context bucket ``context``, with buckets) captured on
        ``backend``: ``(graph, view)``, ``view`` being the staged dummy batch the graph ran
        on (:meth:`capture_view`, :meth:`graph_body`). The runner captures its own graphs
        so; the stale-input audit captures again on the CPU tape, whatever the runner's
        backend. It writes what a capture writes (slot buffers, attention metadata): call
        it between steps."""
        return self.capture_key_on(backend, bs, context, warmup=warmup)

    def capture_key_on(self, backend: GraphBackend, a: int, b: Optional[int] = None, *,
                       warmup: int = 0) -> Tuple[Graph, Any]:
        """:meth:`capture_on` of batch size ``a`` at context bucket ``b``."""
        view = self.capture_view(a, b)
        return self._capture(backend, functools.partial(self.graph_body, view, a), warmup), view

    def _check_key(self, bs: int, context: Optional[int]) -> None:
        if bs not in self.dispatch:
            raise KeyError(f"batch size {bs} is not among the captured sizes {self.captured_sizes}")
        self._check_context(context)

    def _check_context(self, context: Optional[int]) -> None:
        contexts = self.dispatch.contexts
        if contexts is None and context is not None:
            raise KeyError(f"context bucket {context} given, but the runner has no context buckets")
        if contexts is not None and context not in contexts:
            raise KeyError(f"context bucket {context!r} is not among the runner's context buckets {contexts}")

    def graph_body(self, view: Any, bs: int) -> Any:
        """What a graph of size ``bs`` runs on ``view`` (from :meth:`capture_view`): the
        forward (and, ``share_outputs``, the copy of its output into the shared buffers)."""
        with torch.no_grad():
            out = self._forward(view)
        return out if self.shared_outputs is None else self.shared_outputs(out, bs, bs * self.k)

    def capture_view(self, bs: int, context: Optional[int] = None) -> Any:
        """Stage a capture of size ``bs`` (at context bucket ``context``: required with
        buckets, told to the adapter first): the pre-capture hooks, the adapter's dummy
        batch filled through the spec (every row a padded row, as the spec pads at
        replay), its view of the static buffers, DP buffer sizes and the capture metadata.
        Returns the view, which :meth:`graph_body` takes. Raises SlotError naming the dummy
        batch when it does not fit the spec."""
        adapter = self.adapter
        reg = self.registry
        n = bs * self.k
        self._check_context(context)
        if context is not None:
            adapter.set_context_bucket(context)
        reg.run_pre_capture(bs, n, self._side)
        dummy = adapter.make_dummy_batch(bs, n)
        where = f"capturing batch size {bs}: {describe_dummy(adapter, dummy)}"
        try:
            reg.fill_from(dummy, raw_bs=0, padded_bs=bs, raw_num_tokens=0, padded_num_tokens=n, side_inputs=self._side)
        except SlotError as exc:
            raise SlotError(f"{where} does not fit the spec: {exc}") from exc
        try:
            view = reg.extract(dummy, padded_bs=bs, padded_num_tokens=n)
        except SlotError as exc:
            raise SlotError(f"{where} cannot carry the view: {exc}") from exc
        self._set_dp(view, n)
        adapter.init_capture_metadata(bs, n, view)
        self.capture_mode.mark_rows(view, reg)
        return view

    def _set_dp(self, view: Any, num_tokens: int) -> None:
        """Gathered (DP) buffers: every rank runs the padded count; size the gather."""
        if not self.gathered:
            return
        counts = [num_tokens] * self._dp_ranks
        if hasattr(view, "global_num_tokens_cpu"):
            view.global_num_tokens_cpu = counts
        self.adapter.set_dp_buffer_len(counts, sum(counts))

    # -- dispatch --------------------------------------------------------------------
    def _needed_bs(self, fb: Any, raw_bs: int) -> int:
        """Rows the graph must have: with MLP gather, the busiest rank decides."""
        if self.gathered and self._dp_ranks > 1:
            counts = self.adapter.global_num_tokens_cpu(fb)
            if counts:
                return max(raw_bs, self.dispatch.rows_for_tokens(max(counts)))
        return raw_bs

    def _decide(self, fb: Any) -> Tuple[Optional[str], int, Optional[int], Optional[int]]:
        """``(why eager or None, raw_bs, needed_bs, context bucket)``; needed is None for a
        batch that is not a decode step at all (empty, or another forward mode); the
        bucket is None without buckets or when the step runs eager."""
        raw_bs = self.adapter.batch_size(fb)
        tokens_per_bs = self.adapter.tokens_per_bs(fb) if raw_bs >= 1 else None  # an empty batch is read no further
        problem = self.dispatch.step_problem(raw_bs, tokens_per_bs)
        if problem is not None:
            if problem == other_forward_mode(self.k):  # a miscounted batch looks like one: say which it is
                check_batch_rows(self.adapter, self.registry, fb, raw_bs)
            return problem, raw_bs, None, None
        needed = self._needed_bs(fb, raw_bs)
        problem = self.dispatch.size_problem(needed) or (RELEASED if self.released else None)
        if problem is not None or not self.bucketed:
            return problem, raw_bs, needed, None
        longest = self.adapter.context_len(fb)
        problem = self.dispatch.context_problem(longest)
        return problem, raw_bs, needed, None if problem else self.dispatch.pad_context(longest)

    def _context(self, fb: Any, longest: Optional[int]) -> Optional[int]:
        """The bucket ``fb`` replays at (``longest``: its longest context, if known), or None
        without buckets; a ValueError for a step beyond the largest."""
        if not self.bucketed:
            return None
        longest = self.adapter.context_len(fb) if longest is None else longest
        if self.dispatch.context_problem(longest):
            raise ValueError(f"a step whose longest context is {longest} has no graph: the largest context bucket "
                             f"is {self.dispatch.contexts[0]} (can_run is False; run it eager)")
        return self.dispatch.pad_context(longest)

    def eager_reason(self, fb: Any) -> Optional[str]:
        """Why ``fb`` cannot replay a graph, or None when it can."""
        return self._decide(fb)[0]

    def padded_bs(self, fb: Any) -> int:
        return self.dispatch.pad(self._needed_bs(fb, self.adapter.batch_size(fb)))

    def padded_context(self, fb: Any) -> Optional[int]:
        """The context bucket ``fb`` replays at; None without buckets."""
        return self._context(fb, None)

    # -- replay ----------------------------------------------------------------------
    def replay(self, fb: Any, *, count: bool = True) -> Any:
        """Outputs for ``fb``'s rows: views of the graph's static outputs, valid until
        the next replay of the same size (``share_outputs``: of any size; clone to keep
        them). ``count=False``: a batch of no real requests (an idle DP rank's dummy,
        replayed to join the collectives) stays out of :meth:`metrics` and the histogram.
        :meth:`stage` then :meth:`launch`."""
        return self.launch(self.stage(fb, count=count))

    def prepare(self, fb: Any, *, count: bool = True, longest: Optional[int] = None) -> PreparedReplay:
        """:meth:`stage` with the context bucket of ``longest`` (the model runner passes the
        one its dispatch read); None reads ``adapter.context_len(fb)``."""
        return self.stage(fb, longest=longest, count=count)

    def stage(self, fb: Any, *, needed: Optional[int] = None, context: Optional[int] = None,
              longest: Optional[int] = None, count: bool = True) -> PreparedReplay:
        """Stage ``fb`` for its graph: every host step of a replay that can raise (a lazy
        capture, the fill, the observers, extract, the replay metadata, the guard), so
        that :meth:`launch` only replays. Nothing else may fill or replay in between:
        the buffers hold this batch. ``needed``: the rows the graph must have (the DP
        runner passes what the ranks agreed on); None: ``fb``'s own (with MLP gather, the
        busiest rank's). ``context``: the context bucket; None: ``fb``'s own (none without
        buckets). Either smaller than ``fb`` needs (fewer rows than its requests, a bucket
        below its longest context) is a ValueError naming it, before the fill. ``longest``:
        ``fb``'s longest context, when the caller has read it (the DP runner, before its
        exchange); None: ``adapter.context_len(fb)``, read with buckets only.
        ``count=False``: kept out of :meth:`metrics` and the histogram."""
        raw_bs = self.adapter.batch_size(fb)
        needed = self._needed_bs(fb, raw_bs) if needed is None else self._given_needed(needed, raw_bs)
        context = self._context(fb, longest) if context is None else self._given_context(fb, context, longest)
        return self._stage(fb, raw_bs, needed, context, count)

    def _stage(self, fb: Any, raw_bs: int, needed: int, context: Optional[int], count: bool) -> PreparedReplay:
        """:meth:`stage` of a graph known to hold ``fb`` (``needed`` rows, the ``context`` bucket)."""
        adapter = self.adapter
        reg = self.registry
        k = self.k
        bs = self.dispatch.pad(needed)
        self._next_fill()  # from here on the buffers are this step's: a step staged before is stale
        with self._in_step():  # from here to the staged step, release() and recapture() refuse
            graph = self.graph(bs, context)  # before the fill: a lazy capture fills the buffers with its dummy batch
            if context is not None:
                adapter.set_context_bucket(context)
            reg.fill_from(fb, raw_bs=raw_bs, padded_bs=bs, raw_num_tokens=raw_bs * k, padded_num_tokens=bs * k,
                          side_inputs=self._side)
            self._filled(FillShape(raw_bs, bs, raw_bs * k, bs * k))
            view = reg.extract(fb, padded_bs=bs, padded_num_tokens=bs * k)
            self._set_dp(view, bs * k)
            with torch.no_grad():
                adapter.init_replay_metadata(bs, view, fb)
            self._check_guard()
        return PreparedReplay(graph, raw_bs, bs, needed if count else None, context, self.generation, self.fills)

    def _given_needed(self, needed: Any, raw_bs: int) -> int:
        """:meth:`stage`'s ``needed``, checked: a graph holding the batch's rows, never fewer."""
        ok = isinstance(needed, int) and not isinstance(needed, bool) and needed >= raw_bs
        problem = self.dispatch.size_problem(needed) if ok else None
        if not ok or problem:
            why = f": {problem}" if problem else ""
            raise ValueError(f"stage(needed={needed!r}): the batch has {raw_bs} request(s); needed must be an int from "
                             f"{raw_bs} to {self.dispatch.largest} (the largest captured size), or None{why}")
        return needed

    def _given_context(self, fb: Any, context: int, longest: Optional[int]) -> int:
        """:meth:`stage`'s ``context``, checked: a bucket holding the batch's longest context (a
        smaller one attends to fewer positions than the batch has); ``longest`` None: read it."""
        if not self.bucketed:
            return context
        if longest is None:
            longest = self.adapter.context_len(fb)
        if not context >= longest:
            raise ValueError(f"stage(context={context!r}): the batch's longest context is {longest}, more than the "
                             "bucket: its graph attends to fewer positions than the batch has; pass a bucket of at "
                             f"least {longest}, or None")
        return context

    def launch(self, step: PreparedReplay) -> Any:
        """Replay a step :meth:`stage` staged; its outputs, as :meth:`replay` returns them.
        A RuntimeError when the runner was released or recaptured since, or its buffers were
        filled again (stage it again)."""
        self._replay_staged(step.graph, step.generation, step.fill)
        if step.needed is not None:
            self.stats.replayed(step.raw_bs, step.bs, step.needed, step.context)
        k = self.k
        return self.adapter.slice_output(step.graph.output, step.raw_bs, step.raw_bs * k, padded_bs=step.bs,
                                         padded_num_tokens=step.bs * k)

    def record_eager(self, reason: str, needed: Optional[int]) -> None:
        """Count an eager step in :meth:`metrics` and (``needed`` not None) the histogram,
        and log it (:attr:`eager_log`): for a caller that runs the eager forward itself
        (the DP runner)."""
        if needed is None:
            self._record_eager(reason, needed, "decode step ran eager: %s", reason)
        else:  # formatted only when logged
            self._record_eager(reason, needed, self._eager_message, reason, needed)

    def __call__(self, fb: Any) -> Any:
        """Replay when a graph fits, else the eager forward."""
        reason, raw_bs, needed, context = self._decide(fb)
        if reason is None:
            return self.launch(self._stage(fb, raw_bs, needed, context, True))
        self.record_eager(reason, needed)
        return self.adapter.forward_eager(fb)

    # -- the audit hooks -------------------------------------------------------------
    @property
    def verify_sizes(self) -> List[int]:
        """The captured batch sizes (none with ``disable_padding``: no step has a tail)."""
        return [] if self.config.disable_padding else self.captured_sizes

    def step_size(self, fb: Any) -> int:
        return self.adapter.batch_size(fb)

    def padded_size(self, fb: Any) -> int:
        return self.padded_bs(fb)

    def declared_statics(self) -> List[torch.Tensor]:
        """Every phase's (:meth:`~graphslot.runners.step.StepPath.declared_statics`) and the
        shared outputs."""
        declared = super().declared_statics()
        return declared + (self.shared_outputs.tensors() if self.shared_outputs is not None else [])

    def __repr__(self) -> str:
        contexts = f" contexts={self.captured_contexts}" if self.bucketed else ""
        return (f"<DecodeGraphRunner capture={self.capture_mode.name} backend={self.backend.name} "
                f"sizes={self.captured_sizes}{contexts} k={self.k} registry={self.registry.impl}>")
