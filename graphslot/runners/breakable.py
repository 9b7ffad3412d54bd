"""Breakable capture: graph segments with eager steps between them.

``@eager_on_graph`` marks a function that must run eagerly inside a capture (for the
reference model: attention, whose extend metadata depends on per-request lengths).
While a breakable capture is active, calling it

1. ends the current graph segment,
2. runs the function eagerly and records an eager step that, at replay, re-runs it
   with the *same* arguments (static tensors, fixed addresses) and copies its result
   into the tensors it returned at capture,
3. opens the next segment.

Replay alternates segments and eager steps. Outside a breakable capture (eager runs,
warm-ups, other capture modes) the decorator is a plain call, and so is it while
``torch.compile`` traces (the piecewise mode splits at ops, not at this decorator).

Segments are captured with the low-level begin/end form of capture that CUDA graphs
have (``capture_begin``/``capture_end``), which the
:class:`~graphslot.graphs.backend.GraphBackend` protocol declares:
``begin_capture() -> OpenCapture``, whose ``end(output)`` returns the segment's graph
and ``abort()`` abandons it (on CUDA every segment is its own ``CUDAGraph`` in the
backend's shared pool).

The ``breakable`` capture mode (:mod:`graphslot.runners.capture`) captures with
:func:`capture_breakable`, in either phase.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional

import torch

from ..graphs.backend import GraphBackend, GraphCaptureError, OpenCapture
from ..graphs.segments import EagerStep, SegmentedGraph
from ..graphs.util import entered, stream_kwargs, warm_up

# --------------------------------------------------------------------------- decorator

_STATE = threading.local()


def _active() -> Optional["_BreakableCapture"]:
    return getattr(_STATE, "capture", None)


def eager_on_graph(fn: Callable) -> Callable:
    """Mark ``fn`` to run eagerly (a graph break) inside a breakable capture."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cap = None if torch.compiler.is_compiling() else _active()
        if cap is None or cap.in_eager:
            return fn(*args, **kwargs)
        return cap.break_for(fn, args, kwargs)

    wrapper.__graphslot_eager_on_graph__ = fn
    return wrapper


def is_eager_on_graph(fn: Callable) -> bool:
    return hasattr(fn, "__graphslot_eager_on_graph__")


# ------------------------------------------------------------------ segment capture


def begin_segment(backend: GraphBackend, stream: Any = None) -> OpenCapture:
    """Open a capture on ``backend`` (on ``stream``, when given); its ``end(output)``
    returns the segment's Graph."""
    if not isinstance(backend, GraphBackend):
        raise GraphCaptureError(
            f"graph backend {getattr(backend, 'name', type(backend).__name__)!r} cannot capture "
            "segments: it does not implement the GraphBackend protocol (name, capture(fn), "
            "begin_capture() returning an OpenCapture with end(output) and abort())")
    return backend.begin_capture(**stream_kwargs(stream))


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


class _BreakableCapture:
    def __init__(self, backend: GraphBackend, context: Optional[Callable[[], Any]] = None, stream: Any = None) -> None:
        self.backend = backend
        self.context = context
        self.stream = stream
        self._entered = entered(None)
        self.steps: List[Any] = []
        self.in_eager = False
        self.segment: Optional[OpenCapture] = None
        self.last_break = "the start"

    def _open(self) -> None:
        self._entered = entered(self.context)  # the engine's capture context, around each segment
        try:
            self.segment = begin_segment(self.backend, self.stream)
        except BaseException:
            self._entered.close()
            raise

    def _close(self, output: Any) -> Any:
        seg = self.segment
        self.segment = None
        try:
            return seg.end(output)
        except GraphCaptureError as e:
            raise self._located(e) from e
        finally:
            self._entered.close()

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
        self._open()
        return result

    def run(self, fn: Callable[[], Any]) -> SegmentedGraph:
        if _active() is not None:
            raise GraphCaptureError("breakable captures cannot nest")
        _STATE.capture = self
        try:
            self._open()
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
                self._entered.close()
        return SegmentedGraph(self.steps, output)


def capture_breakable(backend: GraphBackend, fn: Callable[[], Any], *, warmup: int = 1,
                      context: Optional[Callable[[], Any]] = None, stream: Any = None) -> SegmentedGraph:
    """Capture ``fn`` as segments split at :func:`eager_on_graph` calls, on ``stream`` (None:
    the backend's choice); ``context``: a factory of context managers entered around each
    segment's capture (the runners enter theirs once per capture session instead)."""
    warm_up(backend, fn, warmup, stream)  # no capture active: marked functions run as plain calls
    return _BreakableCapture(backend, context, stream).run(fn)
