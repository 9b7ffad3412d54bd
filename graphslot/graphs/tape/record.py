"""Recording a tape: the dispatch-mode recorder, captures opened and closed per thread,
and the host-read guard on ``torch.Tensor`` while any capture is open.

Work goes to the innermost open capture of the thread (the one begun last), as a GPU
records into the capture of the current stream. Captures may overlap, in one thread or
several, and end in any order; ``end`` and ``abort`` belong to the thread that began one.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from ..backend import GraphCaptureError
from .checks import HOP_WHY, HOST_READS, MethodCheck, unsupported_error
from .ops import Pins, Record, meta, op_info, tensors, unrecordable
from .replay import TapeGraph


class _Capture:
    """The ops of one open capture, and the first error it met."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.pins = Pins()
        self.error: Optional[GraphCaptureError] = None

    def fail(self, error: GraphCaptureError) -> GraphCaptureError:
        # Like CUDA stream capture, the first error poisons the whole capture even
        # if the callable catches it.
        self.error = self.error or error
        return error

    def record(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        name = str(func)
        error = info.check(name, args, kwargs) if info.check is not None else None
        if error is not None:
            raise self.fail(error)
        out = func(*args, **kwargs)
        why = unrecordable((args, kwargs, out))
        if why is None:
            try:
                metas = [(t, meta(t)) for t in tensors((args, kwargs, out))]
                pinned_args, pinned_kwargs, pinned_out = self.pins.swapped((args, kwargs, out), metas)
            except Exception as e:  # a tensor the checks above let through
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            raise self.fail(unsupported_error(name, why))
        value = out.clone() if info.kind == "scalar" else None
        self.records.append(Record(func, info, pinned_args, pinned_kwargs, pinned_out, value))
        return out


class _ThreadRecorder(TorchDispatchMode):
    """One per thread with captures open: records each op into the innermost one."""

    #: Higher-order operators reach :meth:`__torch_dispatch__`, which refuses them by name.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.captures: list[_Capture] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            raise self.captures[-1].fail(unsupported_error(func.name(), HOP_WHY))
        return self.captures[-1].record(func, args, kwargs or {})


_thread = threading.local()  # .recorder: this thread's _ThreadRecorder while it captures


def _current_capture() -> Optional[_Capture]:
    recorder = getattr(_thread, "recorder", None)
    return recorder.captures[-1] if recorder is not None and recorder.captures else None


# -- host reads that do not dispatch: patched on torch.Tensor while any capture is open -------


def _guarded(original: Callable, check: MethodCheck) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        capture = _current_capture()
        error = check(args, kwargs) if capture is not None else None
        if error is not None:
            raise capture.fail(error)
        return original(self, *args, **kwargs)

    return method


# torch keeps "is a dispatch mode on?" in module globals that each mode saves and
# restores on enter/exit; threads interleaving captures would leave them set for
# good (and Dynamo would then stop compiling), so the guard restores them too.
_DISPATCH_FLAGS = ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                   "_is_in_any_mode_without_ignore_compile_internals")


class _HostReadGuard:
    """Reference counted: the first capture to open patches, the last to close restores."""

    lock = threading.Lock()
    users = 0
    saved_methods: dict[str, Any] = {}  # torch.Tensor.__dict__ entries; None: inherited
    saved_flags: dict[str, Any] = {}

    @classmethod
    def acquire(cls) -> None:
        with cls.lock:
            if cls.users == 0:
                cls.saved_flags = {n: getattr(_python_dispatch, n) for n in _DISPATCH_FLAGS
                                   if hasattr(_python_dispatch, n)}
                for name, check in HOST_READS.items():
                    cls.saved_methods[name] = torch.Tensor.__dict__.get(name)
                    setattr(torch.Tensor, name, _guarded(getattr(torch.Tensor, name), check))
            cls.users += 1

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                cls._restore()

    @classmethod
    def _restore(cls) -> None:
        for name, old in cls.saved_methods.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        for name, value in cls.saved_flags.items():
            setattr(_python_dispatch, name, value)
        setter = getattr(_python_dispatch, "set_is_in_mode_without_ignore_compile_internals", None)
        if setter is not None and _DISPATCH_FLAGS[2] in cls.saved_flags:
            setter(cls.saved_flags[_DISPATCH_FLAGS[2]])


def _open(capture: _Capture) -> None:
    recorder = getattr(_thread, "recorder", None)
    if recorder is None:
        _HostReadGuard.acquire()
        try:
            recorder = _ThreadRecorder()
            recorder.__enter__()
        except BaseException:
            _HostReadGuard.release()
            raise
        _thread.recorder = recorder
    recorder.captures.append(capture)


def _close(capture: _Capture) -> None:
    recorder = getattr(_thread, "recorder", None)
    if recorder is None or capture not in recorder.captures:
        raise GraphCaptureError("a tape capture must end (or abort) in the thread that began it")
    recorder.captures.remove(capture)
    if not recorder.captures:
        _thread.recorder = None
        try:
            recorder.__exit__(None, None, None)
        finally:
            _HostReadGuard.release()


# -- the backend -------------------------------------------------------------------------------


class TapePool:
    """The tape's graph pool: a token (the tape frees nothing into a pool), so that
    sharing one pool across runners is checked on the CPU as on a GPU. It knows the
    graphs captured into it while they live, and :attr:`nbytes`, what they hold."""

    def __init__(self) -> None:
        self._graphs: "weakref.WeakSet[TapeGraph]" = weakref.WeakSet()

    def add(self, graph: TapeGraph) -> None:
        self._graphs.add(graph)

    @property
    def nbytes(self) -> int:
        """Bytes the live graphs of this pool produced (their intermediates and outputs):
        on the tape, the pool's size."""
        return sum(g.nbytes for g in list(self._graphs))

    def __repr__(self) -> str:
        return f"<TapePool {id(self):#x}>"


class TapeBackend:
    """Graph backend ``cpu``: captures :class:`~graphslot.graphs.tape.replay.TapeGraph` s.
    ``pool``: the graph pool handle (:func:`~graphslot.graphs.backend.graph_pool`); None
    makes one."""

    name = "cpu"

    def __init__(self, pool: Optional[TapePool] = None) -> None:
        if pool is not None and not isinstance(pool, TapePool):
            raise TypeError(f"the tape's graph pool must be a TapePool (graphslot.graphs.graph_pool('cpu')), "
                            f"got {type(pool).__name__}")
        self.pool = TapePool() if pool is None else pool
        #: Replays of the graphs this backend captured, counted by the graphs themselves.
        self.replays = 0

    def release(self) -> None:
        """Nothing to give back: each tape graph owns its tensors, freed with it."""

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1, stream: Any = None) -> TapeGraph:
        """``warmup`` plain calls of ``fn``, then one recorded; ``stream`` is a CUDA
        backend's (the tape has no streams)."""
        for _ in range(warmup):
            fn()
        capture = self.begin_capture(stream)
        try:
            output = fn()
        except BaseException:
            capture.abort()
            raise
        return capture.end(output)

    def begin_capture(self, stream: Any = None) -> "OpenTapeCapture":
        """Start recording now; ``end(output)`` returns the graph. For runners that cut
        one run of Python code into several graphs (breakable capture)."""
        return OpenTapeCapture(self)


class OpenTapeCapture:
    """A tape capture in progress: its thread records into it and cannot read the host.

    Captures may overlap, in one thread or several, and end in any order; ``end`` and
    ``abort`` belong to the thread that began the capture. ``backend``: the
    :class:`TapeBackend` it captures for (its graph joins that backend's pool and counts
    its replays there); None: neither.
    """

    def __init__(self, backend: Optional[TapeBackend] = None) -> None:
        self.backend = backend
        self._capture: Optional[_Capture] = _Capture()
        _open(self._capture)

    def end(self, output: Any) -> TapeGraph:
        capture = self._finish()
        if capture.error is not None:
            raise capture.error
        graph = TapeGraph(capture.records, output, capture.pins.given(), owner=self.backend)
        if self.backend is not None:
            self.backend.pool.add(graph)
        return graph

    def abort(self) -> None:
        if self._capture is not None:
            self._finish()

    def _finish(self) -> _Capture:
        capture = self._capture
        if capture is None:
            raise GraphCaptureError("this tape capture has already ended")
        _close(capture)
        self._capture = None
        return capture
