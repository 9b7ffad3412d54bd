"""What every phase runner shares: graphs by key, made by a capture mode, and their lifecycle.

A phase runner (:class:`~graphslot.runners.decode.DecodeGraphRunner`,
:class:`~graphslot.runners.prefill.PrefillGraphRunner`) keys its graphs by a pair: decode
``(bs, context bucket or None)``, prefill ``(tokens, request slots or None)``;
``runner.graphs`` holds each under its first element alone when the second is None,
else under the pair. It says how one key is staged and captured (``capture_key_on``); this
class owns the graph backend (and its pool), the capture mode (:mod:`.capture`), the
capture loop (every key of one run in one capture session, :mod:`.session`, which enters
the engine's capture context once), lazy capture and the lifecycle:

* :meth:`PhaseRunner.release`: every graph dropped, the backend's own pool memory given
  back; steps then run eager (or, ``lazy``, capture on demand);
* :meth:`PhaseRunner.recapture`: the same keys captured again (new weights, LoRA, KV).

Both keep every static input buffer where it is and first reset the index-semantic
ones (``index: true`` slots, which the spec pads with ``zero``): what they held may
index a KV pool, request pool or rope table that has changed since. Both are for
between steps: called while a step runs (from an adapter hook, a step observer, the
forward) they raise, as the step has fetched its graph and filled its buffers already
(:attr:`PhaseRunner.steps_in_progress`); a runner whose lifecycle another owns (the DP
runner's, which every rank must call alike) refuses them too, saying what to call.
Each bumps :attr:`PhaseRunner.generation`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..graphs.backend import Graph, GraphBackend, get_graph_backend
from ..log import progress_bar
from ..spec.kinds import INDEX_SKIP
from .capture import capture_mode, checked_context
from .config import GraphRunnerConfig
from .graph_count import KNOBS, check_graph_count, describe_count
from .piecewise import default_compile_backend
from .report import describe_keys
from .session import CaptureSession, current_session
from .step import StepPath

Key = Tuple[int, Optional[int]]

#: The eager reason of a step after :meth:`PhaseRunner.release` (not lazy).
RELEASED = "graphs released"


class FillCounter:
    """How many times the static buffers a runner stages into (and the model state a
    stage writes, such as attention metadata) were filled, by a step's stage or a capture.
    A staged step is stale once the count moves past it. Runners that stage into the same
    buffers share one (the phase runners of a
    :class:`~graphslot.runners.model_runner.ModelGraphRunner`)."""

    def __init__(self) -> None:
        self.count = 0


class PhaseRunner(StepPath):
    """Base of the phase runners; subclasses set :attr:`phase`, :attr:`key_words` and
    ``capture_key_on``, and call :meth:`_init_graphs` and
    :meth:`~graphslot.runners.step.StepPath._init_step_path` in their constructor. The
    step path both phases share (observers, the replay guard, metrics, the audit hooks)
    is :class:`~graphslot.runners.step.StepPath`'s."""

    #: "decode" or "prefill": logs and progress bars.
    phase = "?"
    #: How a key's two parts read in the capture log.
    key_words = ("batch size", "context buckets")
    config: GraphRunnerConfig
    registry: Any

    def _init_graphs(self, config: GraphRunnerConfig, adapter_split_ops: Optional[Sequence[str]]) -> None:
        if config.warmup_sizes not in ("all", "largest"):
            raise ValueError(f"warmup_sizes must be 'all' or 'largest', got {config.warmup_sizes!r}")
        #: The graph backend; its ``pool`` is :attr:`graph_pool`.
        self.backend: GraphBackend = get_graph_backend(config.backend, self.device, pool=config.graph_pool)
        #: How a graph is made (:mod:`graphslot.runners.capture`).
        self.capture_mode = capture_mode(config.capture, config.split_ops or adapter_split_ops,
                                         config.compile_backend or default_compile_backend(self.backend.name))
        self._capture_context = checked_context(config.capture_context)
        #: Captured graphs by key (lazy: those captured so far).
        self.graphs: Dict[Any, Graph] = {}
        #: True after :meth:`release` (not lazy): steps run eager until :meth:`recapture`.
        self.released = False
        self._released_keys: List[Key] = []
        #: Seconds spent capturing (lazy: so far).
        self.capture_seconds = 0.0
        #: Steps whose host part is running (fetching the graph to replaying it): release()
        #: and recapture() refuse while it is not 0. A count: a DP step holds one around its own.
        self.steps_in_progress = 0
        #: Captures running (:meth:`_capture_keys`): release() and recapture() refuse while it is not 0.
        self.captures_in_progress = 0
        #: Bumped by every release() and recapture(): a step staged before one is stale.
        self.generation = 0
        #: Set by whatever owns this runner's lifecycle (the DP runner): what to call
        #: instead of release() and recapture(), which are then refused.
        self.lifecycle_owner: Optional[str] = None
        #: Counts the fills of the buffers this runner stages into; shared with the runners
        #: that stage into the same ones (:class:`FillCounter`).
        self.fill_counter = FillCounter()

    @property
    def fills(self) -> int:
        """How many steps (and captures) filled the buffers this runner stages into so far."""
        return self.fill_counter.count

    def _next_fill(self) -> None:
        """The buffers are about to be filled: every step staged before is stale."""
        self.fill_counter.count += 1

    def _check_fill(self, fill: int) -> None:
        """A RuntimeError when the buffers were filled since the step of ``fill`` was staged."""
        if fill != self.fill_counter.count:
            raise RuntimeError("this step's buffers were filled again since it was prepared (by another prepare() or "
                               "step) on this runner or on one sharing its buffers (a ModelGraphRunner's): launch each "
                               "staged step before staging the next; prepare it again")

    @property
    def graph_pool(self) -> Any:
        """The memory pool every graph of this runner is captured into."""
        return self.backend.pool

    @staticmethod
    def _key(a: int, b: Optional[int]) -> Any:
        return a if b is None else (a, b)

    @staticmethod
    def _pair(key: Any) -> Key:
        return key if isinstance(key, tuple) else (key, None)

    # -- capture ---------------------------------------------------------------------
    def _check_key(self, a: int, b: Optional[int]) -> None:
        """A KeyError for a key this runner does not capture."""

    def _capture(self, backend: GraphBackend, run: Any, warmup: int) -> Graph:
        """``run`` captured by the capture mode on ``backend``: on the runner's own backend,
        inside the capture session (:mod:`.session`), on the stream its context yielded."""
        session = current_session()
        stream = session.stream if session is not None and backend is self.backend else None
        return self.capture_mode.capture(backend, run, warmup=warmup, stream=stream)

    def _warmup(self) -> int:
        return self.config.warmup if not self.graphs or self.config.warmup_sizes == "all" else 0

    @property
    def what(self) -> str:
        """The runner in logs: ``"decode"``, ``"breakable prefill"`` ... (the capture mode
        named unless ``full``)."""
        return self.phase if self.capture_mode.name == "full" else f"{self.capture_mode.name} {self.phase}"

    def _session(self, keys: Sequence[Key]) -> CaptureSession:
        return CaptureSession(context=self._capture_context, backend=self.backend, device=self.device,
                              log=self._log, what=self.what, keys=describe_keys(keys, *self.key_words),
                              graphs=len(keys), static_bytes=self.registry.nbytes)

    def _capture_keys(self, keys: Sequence[Key]) -> float:
        """Capture ``keys`` in order (largest first), in one capture session; seconds taken.
        Refused before any capture when the runner would then hold more than ``max_graphs``
        graphs."""
        planned = {self._pair(k) for k in self.graphs} | set(keys)
        what = f"{self.phase} capture={self.capture_mode.name!r} ({describe_count(planned, *self.key_words)})"
        check_graph_count(len(planned), self.config.max_graphs, what, KNOBS[self.phase], lazy_hint=not self.config.lazy)
        bar = progress_bar(keys, show=self.config.progress, desc=f"Capturing {self.phase} graphs", unit="graph",
                           leave=False)
        first = not self.graphs  # no graph read the tensors as they were before: the guard's snapshot is now
        self._next_fill()  # a capture fills the buffers with dummy batches
        self.captures_in_progress += 1
        try:
            with self._session(keys) as session:
                for a, b in bar:
                    self.graphs[self._key(a, b)] = self._capture_one(a, b)
                    session.captured(bar)
        finally:
            self.captures_in_progress -= 1
        self.capture_seconds += session.seconds
        if first and self.guard is not None:
            self.guard.refresh()
        return session.seconds

    def capture_all(self) -> None:
        """Capture every key not captured yet (after ``defer_capture``; construction does
        it otherwise)."""
        self._capture_keys([key for key in self.graph_keys if self._key(*key) not in self.graphs])

    def _capture_one(self, a: int, b: Optional[int]) -> Graph:
        """The runner's own graph of key ``(a, b)``."""
        return self.capture_key_on(self.backend, a, b, warmup=self._warmup())[0]

    def _replay_staged(self, graph: Graph, generation: int, fill: int) -> None:
        """Replay a staged step's ``graph``; a RuntimeError when the runner was released or
        recaptured since it was staged (at ``generation``), or its buffers were filled
        since (at ``fill``)."""
        if generation != self.generation:
            raise RuntimeError("this step was prepared before a release() or recapture(): its graph and buffers are "
                               "stale; prepare it again")
        self._check_fill(fill)
        with self._in_step():  # eager segments and split ops run engine code during the replay
            graph.replay()

    def graph(self, a: int, b: Optional[int] = None) -> Graph:
        """The graph of key ``(a, b)`` (decode: batch size ``bs`` and context bucket or
        None), captured now if not yet (lazy, or released); a KeyError for a key the
        runner does not capture."""
        graph = self.graphs.get(self._key(a, b))
        if graph is None:
            self._check_key(a, b)
            self._capture_keys([(a, b)])
            graph = self.graphs[self._key(a, b)]
        return graph

    def can_run(self, fb: Any) -> bool:
        """Whether ``fb`` replays a graph (the subclass's ``eager_reason(fb)`` is None)."""
        return self.eager_reason(fb) is None

    @property
    def static_bytes(self) -> int:
        """Bytes of the static input buffers."""
        return self.registry.nbytes

    # -- lifecycle -------------------------------------------------------------------
    def reset_index_buffers(self) -> None:
        """Reset every index-semantic slot buffer in place to what a padded row holds (``index: true``: zero,
        ``index: skip``: its negative pad value), a staged slot's two: nothing stale indexes a pool."""
        for slot in self.registry.active:
            index = slot.resolved.index
            for buffer in slot.buffers() if index else ():
                buffer.fill_(slot.resolved.pad_value if index == INDEX_SKIP else 0)

    def check_lifecycle_call(self, call: str, *, owner: bool = False) -> None:
        """Raise when ``call`` (``"release()"``, ``"recapture()"``) may not run now: a step
        is in progress, or (``owner`` False) another object owns the lifecycle."""
        if self.steps_in_progress:
            raise RuntimeError(
                f"{call} was called during a {self.phase} step (from an adapter hook such as init_replay_metadata, "
                f"a step observer, or the forward): the step has fetched its graph and filled its buffers, which "
                f"{call} would drop or overwrite before the replay; call {call} between steps")
        if self.captures_in_progress:
            raise RuntimeError(
                f"{call} was called during a capture of {self.phase} graphs (from an adapter hook such as "
                f"init_capture_metadata, or the forward): it would drop or replace the graphs being captured; call "
                f"{call} between steps")
        if self.lifecycle_owner is not None and not owner:
            raise RuntimeError(f"{call} on this {self.phase} runner: {self.lifecycle_owner}")

    def release(self) -> None:
        """Drop every graph and give the backend's own pool memory back (a pool the engine
        gave is the engine's to empty). Steps then run eager, or, ``lazy``, capture again
        on demand. The static input buffers stay where they are. Between steps only
        (:meth:`check_lifecycle_call`)."""
        self.check_lifecycle_call("release()")
        self.release_graphs()

    def recapture(self) -> None:
        """Capture the keys captured so far (or before :meth:`release`) again, after the
        weights, a LoRA or the KV cache changed; the static input buffers stay where they
        are. Nothing captured yet (lazy): nothing to do. Between steps only
        (:meth:`check_lifecycle_call`)."""
        self.check_lifecycle_call("recapture()")
        self.recapture_graphs()

    @property
    def recapture_keys(self) -> List[Key]:
        """The keys :meth:`recapture` captures: those captured, else those captured before
        the last :meth:`release` (or a recapture cut short)."""
        return [self._pair(k) for k in self.graphs] or list(self._released_keys)

    def release_graphs(self) -> None:
        """:meth:`release` once allowed (for the lifecycle's owner, which checks first)."""
        if self.graphs:
            self._released_keys = [self._pair(k) for k in self.graphs]
        self.generation += 1
        self.reset_index_buffers()
        self.graphs.clear()
        self.backend.release()
        self.released = not self.config.lazy

    def recapture_graphs(self) -> None:
        """:meth:`recapture` once allowed (for the lifecycle's owner, which checks first)."""
        keys = self.recapture_keys
        self.release_graphs()
        try:
            self._capture_keys(keys)
        except BaseException:  # cut short: released, so that the next recapture() captures every key again
            self.graphs.clear()
            self.backend.release()
            self._released_keys = keys
            self.released = not self.config.lazy
            raise
        self.released = False
