"""What every phase runner's step path shares, whatever the phase.

A step, in both phases: fetch the graph (capturing it, lazy), fill the slot buffers,
let the observers see the filled buffers (:class:`StepObserver`), run the replay hooks,
check the replay guard (:mod:`.guard`), replay, and count the step (:mod:`.metrics`);
or run eager, counted and logged by reason. :class:`StepPath` holds these concerns for
:class:`~graphslot.runners.phase.PhaseRunner`: the observers, the guard, the counters and
histogram, the eager log, and the hooks the audit of ``graphslot verify`` uses
(:meth:`StepPath.declared_statics`, :meth:`StepPath.external_inputs`,
:attr:`StepPath.last_fill`, :meth:`StepPath.step_size`, :meth:`StepPath.padded_size`,
:attr:`StepPath.verify_sizes`). What a phase fills and replays is the phase's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Protocol, Tuple

import torch

from ..graphs.backend import Graph, GraphBackend, InspectableGraph, get_graph_backend
from ..log import PerReason
from ..planning.histogram import BatchSizeHistogram
from .contract import statics
from .guard import ReplayGuard, guard_wanted, runner_tensors
from .metrics import RunnerMetrics


class StepObserver(Protocol):
    """Sees every replayed step of a phase runner it is added to."""

    def after_fill(self, raw_bs: int, padded_bs: int) -> None:
        """The slot buffers hold the step (``raw_bs`` real requests padded to ``padded_bs``
        request rows; a prefill's token counts are in the runner's ``last_fill``);
        extract, the replay metadata and the replay follow."""
        ...


class FillShape(NamedTuple):
    """The counts a step was filled with (:attr:`StepPath.last_fill`)."""

    raw_bs: int
    padded_bs: int
    raw_tokens: int
    padded_tokens: int


class StepPath:
    """The step concerns every phase runner shares; :meth:`_init_step_path` sets them up
    (after the registry and adapter exist, before any capture)."""

    phase = "?"
    #: What :meth:`step_size` counts: ``"requests"`` (decode) or ``"tokens"`` (prefill).
    size_unit = "requests"
    registry: Any
    adapter: Any
    device: Any
    backend: GraphBackend
    #: The replay guard (:mod:`.guard`, when on), re-armed whenever graphs are captured
    #: with none before (construction, recapture, after release); None: off.
    guard: Optional[ReplayGuard] = None
    #: The counts of the step filled last (None before the first): what an observer's
    #: slot counts come from (``slot.count(raw_bs, raw_tokens)``).
    last_fill: Optional[FillShape] = None

    def _init_step_path(self, guard: Optional[bool], log: Any, *, num_tokens_per_bs: int = 1,
                        contexts: bool = False) -> None:
        self.guard = ReplayGuard(lambda: runner_tensors(self.registry, self.adapter)) if guard_wanted(guard) else None
        #: Counters of replays, padding and eager fallbacks (``metrics()``), and the sizes
        #: served (``histogram``).
        self.stats = RunnerMetrics(num_tokens_per_bs=num_tokens_per_bs, contexts=contexts)
        #: Eager fallbacks logged (INFO), per reason: the first, then every 1000th.
        self.eager_log = PerReason(log)
        self._observers: Tuple[StepObserver, ...] = ()

    # -- observers -------------------------------------------------------------------
    def add_observer(self, observer: StepObserver) -> None:
        """Call ``observer.after_fill(raw_bs, padded_bs)`` at every replayed step, in the
        order observers were added. Without observers a step pays one emptiness check."""
        self._observers = (*self._observers, observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer`` (ValueError if it was not added)."""
        observers = list(self._observers)
        observers.remove(observer)
        self._observers = tuple(observers)

    def _filled(self, shape: FillShape) -> None:
        """The slot buffers hold a step of ``shape``: the observers see it."""
        self.last_fill = shape
        if self._observers:
            for observer in self._observers:
                observer.after_fill(shape.raw_bs, shape.padded_bs)

    def _check_guard(self) -> None:
        """The replay guard's check (nothing when it is off): right before a replay."""
        if self.guard is not None:
            self.guard.check()

    # -- metrics ---------------------------------------------------------------------
    def metrics(self) -> Dict[str, Any]:
        """Replays per captured size (decode: batch size, with buckets per context bucket
        too; prefill: token bucket), padded rows and eager fallbacks by reason."""
        return self.stats.as_dict()

    @property
    def histogram(self) -> BatchSizeHistogram:
        """The sizes served, replayed or eager (decode: batch sizes, with DP attention the
        busiest rank's; prefill: token counts): ``.counts``, ``.save(path)``."""
        return self.stats.histogram

    def _record_eager(self, reason: str, needed: Optional[int], message: str, *args: Any) -> None:
        self.stats.fell_back(reason, needed)
        self.eager_log.log(reason, message, *args)

    # -- the audit hooks of ``graphslot verify`` -------------------------------------
    def capture_key_on(self, backend: GraphBackend, a: int, b: Optional[int] = None, *,
                       warmup: int = 0) -> Tuple[Graph, Any]:
        """Key ``(a, b)`` captured on ``backend``: ``(graph, view)``, ``view`` being the
        staged dummy batch the graph ran on. The stale-input audit captures so on the
        CPU tape, whatever the runner's backend; it writes what a capture writes (slot
        buffers, metadata): call it between steps."""
        raise NotImplementedError

    def declared_statics(self) -> List[torch.Tensor]:
        """Slot buffers, the adapter's static tensors and its models' parameters and
        buffers (:func:`~graphslot.runners.contract.statics`): what a graph may read."""
        return [s.buffer for s in self.registry.active] + statics(self.adapter)

    def external_inputs(self, a: int, b: Optional[int] = None) -> List[torch.Tensor]:
        """Tensors the graph of key ``(a, b)`` reads that nothing keeps current: not a slot
        buffer, not declared static by the adapter, not made by the graph. A graph that
        cannot list them (CUDA) has the key captured again on the tape to find them."""
        graph = self.graph(a, b)  # PhaseRunner's
        if not isinstance(graph, InspectableGraph):
            graph = self.capture_key_on(get_graph_backend("cpu", "cpu"), a, b)[0]
        return graph.external_inputs(self.declared_statics())

    @property
    def verify_sizes(self) -> List[int]:
        """The padded sizes whose tails ``graphslot verify`` poisons (decode: batch sizes,
        prefill: token buckets)."""
        raise NotImplementedError

    def step_size(self, fb: Any) -> int:
        """``fb``'s raw size in :attr:`verify_sizes`' unit."""
        raise NotImplementedError

    def padded_size(self, fb: Any) -> int:
        """The size of :attr:`verify_sizes` ``fb`` replays at."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """A step's host part is running: release() and recapture() refuse meanwhile."""
        self.steps_in_progress += 1
        try:
            yield
        finally:
            self.steps_in_progress -= 1
