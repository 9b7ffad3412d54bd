"""Capture modes: how a phase runner's callable becomes a :class:`~graphslot.graphs.backend.Graph`.

A phase runner (:mod:`.decode`, :mod:`.prefill`) knows what a step's inputs are and
owns dispatch, fill, metadata, replay and the eager fallback; a capture mode has one
job, turning the callable that runs one graph key into a graph, on any backend:

========== =====================================================
capture    a graph is
========== =====================================================
full       one backend graph
breakable  backend graph segments cut at ``@eager_on_graph``
           calls (:mod:`.breakable`)
piecewise  ``torch.compile`` split at the adapter's split ops,
           each piece a backend graph (:mod:`.piecewise`)
========== =====================================================

``compile(fn)`` is what the runner calls inside its graph body instead of ``fn`` (the
decode forward, the prefill layer stack): ``fn`` itself, or (piecewise) ``fn`` compiled
to split at the split ops. ``capture(backend, run, warmup=, stream=)`` captures one run
of ``run`` on ``stream`` (the capture session's, :mod:`.session`; None: the backend's
choice). The runners enter the engine's capture context once per session; a caller
outside one may pass ``context=`` (a factory of context managers), entered around each
graph, segment or piece as before. The runner checks the factory first
(:func:`checked_context`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import torch

from ..graphs.backend import Graph, GraphBackend
from ..graphs.util import entered, stream_kwargs
from .breakable import capture_breakable
from .piecewise import COMPILE_BACKENDS, capture_piecewise, compile_piecewise, mark_dynamic_rows, view_rows

#: The capture modes, by name.
CAPTURE_MODES = ("full", "breakable", "piecewise")

ContextFactory = Optional[Callable[[], ContextManager[Any]]]


class FullCapture:
    """``full``: one graph per key; attention runs inside it, on metadata the hooks write
    into static buffers."""

    name = "full"

    def compile(self, fn: Callable) -> Callable:
        return fn

    def mark_rows(self, view: Any, registry: Any) -> None:
        """Tell the compiler which dimensions of a staged view change with the key (piecewise)."""

    def capture(self, backend: GraphBackend, run: Callable[[], Any], *, warmup: int,
                context: ContextFactory = None, stream: Any = None) -> Graph:
        with entered(context):
            return backend.capture(run, warmup=warmup, **stream_kwargs(stream))


class BreakableCapture(FullCapture):
    """``breakable``: segments between :func:`~graphslot.runners.breakable.eager_on_graph`
    calls, which run eagerly at every replay."""

    name = "breakable"

    def capture(self, backend: GraphBackend, run: Callable[[], Any], *, warmup: int,
                context: ContextFactory = None, stream: Any = None) -> Graph:
        return capture_breakable(backend, run, warmup=warmup, context=context, stream=stream)


class PiecewiseCapture:
    """``piecewise``: the runner's callable traced once, split at ``split_ops`` (custom op
    names, ``"ns::name"``), which run eagerly between the captured pieces, and each piece
    compiled once by ``compile_backend`` (:mod:`.piecewise`)."""

    name = "piecewise"

    def __init__(self, split_ops: Sequence[str], compile_backend: Any = "aot_eager") -> None:
        if not split_ops:
            raise ValueError("capture='piecewise' needs split ops: pass split_ops=(\"ns::op\", ...) (the custom ops "
                             "the compiled function is split at, e.g. attention), or set the adapter's split_ops")
        self.split_ops: Tuple[str, ...] = tuple(split_ops)
        if not isinstance(compile_backend, str) and not callable(compile_backend):
            raise TypeError(f"compile_backend must be a Dynamo backend name ({', '.join(COMPILE_BACKENDS)}, ...) "
                            f"or a (gm, example_inputs) callable, got {compile_backend!r} "
                            f"({type(compile_backend).__name__})")
        known = torch._dynamo.list_backends(exclude_tags=())
        if isinstance(compile_backend, str) and compile_backend not in known:
            raise ValueError(f"unknown compile_backend {compile_backend!r}: "
                             f"choose one of {', '.join(COMPILE_BACKENDS)} "
                             "(or another torch._dynamo.list_backends() name, or a (gm, example_inputs) callable)")
        self.compile_backend = compile_backend

    def compile(self, fn: Callable) -> Callable:
        return compile_piecewise(fn, self.split_ops, self.compile_backend)

    def mark_rows(self, view: Any, registry: Any) -> None:
        """The padded dimension of every ``bs``/``tokens`` slot in ``view`` is symbolic: one
        trace for every key."""
        mark_dynamic_rows(view_rows(view, registry))

    def capture(self, backend: GraphBackend, run: Callable[[], Any], *, warmup: int,
                context: ContextFactory = None, stream: Any = None) -> Graph:
        return capture_piecewise(backend, run, self.split_ops, warmup=warmup, context=context, stream=stream)


def capture_mode(name: str, split_ops: Optional[Sequence[str]] = None, compile_backend: Any = "aot_eager") -> Any:
    """The capture mode called ``name``; ``split_ops`` and ``compile_backend`` are
    piecewise's (ignored otherwise)."""
    if name == "full":
        return FullCapture()
    if name == "breakable":
        return BreakableCapture()
    if name == "piecewise":
        return PiecewiseCapture(split_ops or (), compile_backend)
    raise ValueError(f"unknown capture mode {name!r}; choose one of: {', '.join(CAPTURE_MODES)}")


#: What ``capture_context=`` must be, for the errors that say it was not.
CONTEXT_RULE = ("capture_context must be a zero-argument callable returning a fresh context manager each call (a "
                "@contextlib.contextmanager function itself, sglang's graph_capture, lambda: my_context())")


def _is_context_manager(value: Any) -> bool:
    kind = type(value)
    return hasattr(kind, "__enter__") and hasattr(kind, "__exit__")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {repr(value)[:80]}"


def checked_context(factory: ContextFactory) -> ContextFactory:
    """The engine's ``capture_context`` factory, checked now (a TypeError naming
    ``capture_context`` when it is no zero-argument callable, or is a context manager
    object rather than a factory of them) and at each call (:class:`_CheckedContext`)."""
    if factory is None:
        return None
    if not callable(factory) or (not isinstance(factory, type) and _is_context_manager(factory)):
        raise TypeError(f"{CONTEXT_RULE}; got {_describe(factory)}")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise TypeError(f"{CONTEXT_RULE}; got {_describe(factory)}, which needs arguments") from None
    except ValueError:  # no signature to read (a builtin): the first call tells
        pass
    return _CheckedContext(factory)


class _CheckedContext:
    """A ``capture_context`` factory whose every result is checked: a context manager
    (else a TypeError naming ``capture_context``), and, when it is the very object an
    earlier call returned, one that can be entered again (a ``@contextmanager`` object
    cannot: a TypeError saying so instead of its own ``AttributeError``)."""

    def __init__(self, factory: Callable[[], ContextManager[Any]]):
        self.factory = factory
        self._last: Any = None

    def __call__(self) -> ContextManager[Any]:
        made = self.factory()
        if not _is_context_manager(made):
            raise TypeError(f"capture_context() returned {_describe(made)}, not a context manager; {CONTEXT_RULE}")
        again = made is self._last
        self._last = made
        return _Unsuppressing(_Reentered(made) if again else made)


class _Unsuppressing:
    """A ``capture_context`` result whose ``__exit__`` cannot swallow an error raised in the
    capture (a graph cut short would be kept): the error propagates, with a note."""

    def __init__(self, inner: ContextManager[Any]):
        self.inner = inner

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        if self.inner.__exit__(kind, error, trace) and error is not None:
            name = type(self.inner.inner if isinstance(self.inner, _Reentered) else self.inner).__name__
            error.add_note(f"graphslot: capture_context's context manager ({name}) suppressed this error (its "
                           "__exit__ returned True); a capture that failed cannot be kept, so it propagates")
        return False


class _Reentered:
    """A context manager ``capture_context`` returned before: entered through this, so a
    one-shot one fails with an error naming ``capture_context``."""

    def __init__(self, inner: ContextManager[Any]):
        self.inner = inner

    def __enter__(self) -> Any:
        try:
            return self.inner.__enter__()
        except Exception as exc:
            raise TypeError(f"capture_context() returned the same {type(self.inner).__name__} object as at an earlier "
                            f"capture, and entering it again failed ({type(exc).__name__}: {exc}): it can be entered "
                            f"once only (as a @contextmanager one); {CONTEXT_RULE}") from exc

    def __exit__(self, *exc_info: Any) -> Any:
        return self.inner.__exit__(*exc_info)
