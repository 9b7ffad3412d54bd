"""The breakable prefill graph runner: graph segments with eager steps between them.

``@eager_on_graph`` marks a function that must run eagerly inside a capture (for the
reference model: attention, whose extend metadata depends on per-request lengths).
While a breakable capture is active, calling it

1. ends the current graph segment,
2. runs the function eagerly and records an eager step that, at replay, re-runs it
   with the *same* arguments (static tensors, fixed addresses) and copies its result
   into the tensors it returned at capture,
3. opens the next segment.

Replay alternates segments and eager steps. Outside a breakable capture (eager runs,
warm-up, the decode runner) the decorator is a plain call.

Segments are captured with the low-level begin/end form of capture that CUDA graphs
have (``capture_begin``/``capture_end``), which the
:class:`~graphslot.graphs.backend.GraphBackend` protocol declares:
``begin_capture() -> OpenCapture``, whose ``end(output)`` returns the segment's graph
and ``abort()`` abandons it (on CUDA every segment is its own ``CUDAGraph`` in the
backend's shared pool).

The runner's bucket schedule, capture loop and replay are those of every prefill
runner (:mod:`graphslot.runners.prefill`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional

import torch

from ..graphs.backend import GraphBackend, GraphCaptureError, OpenCapture
from ..graphs.segments import EagerStep, SegmentedGraph
from .prefill import PrefillGraphRunner

# --------------------------------------------------------------------------- decorator

_STATE = threading.local()


def _active() -> Optional["_BreakableCapture"]:
    return getattr(_STATE, "capture", None)


def eager_on_graph(fn: Callable) -> Callable:
    """Mark ``fn`` to run eagerly (a graph break) inside a breakable capture."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cap = _active()
        if cap is None or cap.in_eager:
            return fn(*args, **kwargs)
        return cap.break_for(fn, args, kwargs)

    wrapper.__graphslot_eager_on_graph__ = fn
    return wrapper


def is_eager_on_graph(fn: Callable) -> bool:
    return hasattr(fn, "__graphslot_eager_on_graph__")


# ------------------------------------------------------------------ segment capture


def begin_segment(backend: GraphBackend) -> OpenCapture:
    """Open a capture on ``backend``; its ``end(output)`` returns the segment's Graph."""
    if not isinstance(backend, GraphBackend):
        raise GraphCaptureError(
            f"graph backend {getattr(backend, 'name', type(backend).__name__)!r} cannot capture "
            "segments: it does not implement the GraphBackend protocol (name, capture(fn), "
            "begin_capture() returning an OpenCapture with end(output) and abort())")
    return backend.begin_capture()


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


class _BreakableCapture:
    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.steps: List[Any] = []
        self.in_eager = False
        self.segment: Optional[OpenCapture] = None
        self.last_break = "the start"

    def _close(self, output: Any) -> Any:
        seg, self.segment = self.segment, None
        try:
            return seg.end(output)
        except GraphCaptureError as e:
            raise self._located(e) from e

    def _located(self, e: GraphCaptureError) -> GraphCaptureError:
        done = sum(not isinstance(s, EagerStep) for s in self.steps)
        return GraphCaptureError(f"breakable capture, segment {done} (after {self.last_break}): {e}")

    def break_for(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.steps.append(self._close(None))
        self.in_eager = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self.in_eager = False
        self.steps.append(EagerStep(_fn_name(fn), fn, args, kwargs, result))
        self.last_break = f"eager step {_fn_name(fn)}"
        self.segment = begin_segment(self.backend)
        return result

    def run(self, fn: Callable[[], Any]) -> SegmentedGraph:
        if _active() is not None:
            raise GraphCaptureError("breakable captures cannot nest")
        _STATE.capture = self
        try:
            self.segment = begin_segment(self.backend)
            try:
                output = fn()
            except GraphCaptureError as e:
                raise self._located(e) from e
            self.steps.append(self._close(output))
        finally:
            _STATE.capture = None
            if self.segment is not None:
                self.segment.abort()
                self.segment = None
        return SegmentedGraph(self.steps, output)


def capture_breakable(backend: GraphBackend, fn: Callable[[], Any], *, warmup: int = 1) -> SegmentedGraph:
    """Capture ``fn`` as segments split at :func:`eager_on_graph` calls."""
    for _ in range(warmup):
        fn()  # no capture active: marked functions run as plain calls
    return _BreakableCapture(backend).run(fn)


# ------------------------------------------------------------------------- runner


class BreakableGraphRunner(PrefillGraphRunner):
    """Captures the layer stack per token bucket, cut at :func:`eager_on_graph` calls."""

    kind = "breakable"

    def capture_stack(self, n: int, hidden: torch.Tensor, view: Any) -> SegmentedGraph:
        adapter, stack = self.adapter, self.stack

        def run():
            with torch.no_grad():
                return adapter.run_layer_stack(stack, hidden, view)

        return capture_breakable(self.backend, run, warmup=self.config.warmup)
