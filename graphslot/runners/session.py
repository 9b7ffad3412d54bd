"""The capture session: every graph of one ``capture()`` or ``recapture()``, captured at once.

A phase runner captures its keys (:meth:`~graphslot.runners.phase.PhaseRunner._capture_keys`:
construction, ``capture_all()``, ``recapture()``, a lazy capture of one key) inside one
:class:`CaptureSession`, which

1. enters the engine's ``capture_context`` **once**: every graph, segment and piece of
   the session is captured inside that one entry (with sglang's custom all-reduce each
   exit of ``graph_capture()`` is a registration collective, so one per graph was one
   collective per graph);
2. captures on the **stream the context yields** (an object with ``.stream``, as sglang's
   ``graph_capture()`` yields, or a stream itself): :attr:`CaptureSession.stream`, which the
   runner passes to the backend's ``capture(..., stream=)``; None: the backend's own;
3. runs **one** ``gc.collect()`` and (on a CUDA device) **one** ``torch.cuda.empty_cache()``
   at the start, then patches both to no-ops until it ends (restored on error too), as
   the engines do: ``torch.cuda.graph`` empties the cache, and collects, at every
   capture, which made a piecewise capture (a graph per piece per size) slow. Automatic
   collection is paused too (:func:`~graphslot.graphs.util.no_collection`);
4. **logs** the graph count before capturing; after the first (largest) key, the
   estimate of the memory the session needs: the static buffers plus the graph pool's
   growth for the first key times the keys (on a GPU the allocator's reserved memory;
   on the tape, what the tape's pool holds, ``TapePool.nbytes``);
   it is also shown on the progress bar. At the end it logs the time taken and the
   pool's real growth.

A session opened while another is open in the same thread joins it: the outer session
has entered the context and collected; the inner one only counts, times and logs its
own graphs. One model's phases captured together so share one entry.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from ..graphs.tape import TapePool
from ..graphs.util import no_collection
from ..spec.budget import human_bytes

_ACTIVE = threading.local()


def current_session() -> Optional["CaptureSession"]:
    """The session open in this thread (the outermost), or None."""
    return getattr(_ACTIVE, "session", None)


def stream_of(entered: Any) -> Any:
    """The capture stream a capture context yielded: its ``.stream`` (sglang's
    ``graph_capture()`` yields such an object), or the value itself when it is a stream;
    None otherwise (the backend then captures on a stream of its own)."""
    if entered is None:
        return None
    if hasattr(entered, "stream"):
        return entered.stream
    stream_types = tuple(t for t in (getattr(torch, "Stream", None), getattr(torch.cuda, "Stream", None)) if t)
    return entered if isinstance(entered, stream_types) else None


def pool_bytes(backend: Any, device: torch.device) -> Optional[int]:
    """What the graph pool holds now: the tape pool's bytes, or on a CUDA device the memory
    torch's caching allocator reserved (the graph pools are part of it); None if unknown."""
    pool = getattr(backend, "pool", None)
    if isinstance(pool, TapePool):  # the tape's, whatever wraps its backend
        return pool.nbytes
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_reserved(device)
    return None


def _no_collect(*_: Any) -> int:
    return 0


def _no_empty_cache() -> None:
    return None


@contextlib.contextmanager
def collectors_patched() -> Iterator[None]:
    """``gc.collect`` and ``torch.cuda.empty_cache`` are no-ops inside; restored after,
    even on error."""
    collect = gc.collect
    empty_cache = torch.cuda.empty_cache
    gc.collect = _no_collect
    torch.cuda.empty_cache = _no_empty_cache
    try:
        yield
    finally:
        gc.collect = collect
        torch.cuda.empty_cache = empty_cache


class CaptureSession:
    """One capture run of a runner (module docstring): ``with CaptureSession(...) as s:``,
    capture each key on ``s.stream``, and call ``s.captured(bar)`` after each.

    ``context``: the engine's factory of context managers (``capture_context=``), or None;
    ``backend``, ``device``: where the graphs go (for the pool's size); ``log``, ``what``
    (``"decode"``, ``"piecewise prefill"``, ...), ``keys`` (the keys in words) and
    ``graphs`` (how many) for the logs; ``static_bytes``: the static input buffers."""

    def __init__(self, *, context: Optional[Callable[[], ContextManager[Any]]], backend: Any, device: torch.device,
                 log: logging.Logger, what: str, keys: str, graphs: int, static_bytes: int) -> None:
        self.context = context
        self.backend = backend
        self.device = torch.device(device)
        self.log = log
        self.what = what
        self.keys = keys
        self.graphs = graphs
        self.static_bytes = static_bytes
        #: The stream graphs are captured on (what the context yielded), or None.
        self.stream: Any = None
        #: Graphs captured so far (keys: a key's pieces are one).
        self.count = 0
        #: Seconds the session took (set when it ends).
        self.seconds = 0.0
        #: The graph pool's growth for the first key, and for the whole session (None: unknown).
        self.first_growth: Optional[int] = None
        self.growth: Optional[int] = None
        self._outer: Optional[CaptureSession] = None
        self._stack = contextlib.ExitStack()

    @property
    def joined(self) -> bool:
        """Whether this session joined one already open (which entered the context)."""
        return self._outer is not None

    def __enter__(self) -> "CaptureSession":
        self._outer = current_session()
        if self._outer is not None:
            self.stream = self._outer.stream
        else:
            self._open()
        self._pool_before = pool_bytes(self.backend, self.device)
        self._start = time.perf_counter()
        self.log.info("capturing %d %s graph%s (%s), backend %s; static buffers %s", self.graphs, self.what,
                      "s" if self.graphs != 1 else "", self.keys, self.backend.name, human_bytes(self.static_bytes))
        return self

    def _open(self) -> None:
        stack = self._stack
        try:
            if self.context is not None:
                self.stream = stream_of(stack.enter_context(self.context()))
            gc.collect()  # the session's one collection ...
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.empty_cache()  # ... and its one emptying of the cache
            stack.enter_context(collectors_patched())
            stack.enter_context(no_collection())
        except BaseException:
            stack.close()
            raise
        _ACTIVE.session = self

    def __exit__(self, kind: Any, error: Any = None, trace: Any = None) -> None:
        self.seconds = time.perf_counter() - self._start
        after = pool_bytes(self.backend, self.device)
        if after is not None and self._pool_before is not None:
            self.growth = max(after - self._pool_before, 0)
        if self._outer is None:
            _ACTIVE.session = None
            self._stack.__exit__(kind, error, trace)  # the engine's context sees the error (it cannot swallow it)
        if kind is not None or not self.count:
            return
        grown = "" if self.growth is None else f"; graph pool +{human_bytes(self.growth)}"
        self.log.info("captured %d %s graph%s (%s), backend %s, in %.2f s; static buffers %s%s", self.count, self.what,
                      "s" if self.count != 1 else "", self.keys, self.backend.name, self.seconds,
                      human_bytes(self.static_bytes), grown)

    def captured(self, bar: Any = None) -> None:
        """One more key captured; after the first of several, log (and show on ``bar``) the
        memory estimate: static buffers + the first key's pool growth x keys."""
        self.count += 1
        if self.count != 1 or self.graphs < 2 or self._pool_before is None:
            return
        self.first_growth = max((pool_bytes(self.backend, self.device) or 0) - self._pool_before, 0)
        total = self.static_bytes + self.first_growth * self.graphs
        estimate = (f"about {human_bytes(total)} (static buffers {human_bytes(self.static_bytes)} + "
                    f"{human_bytes(self.first_growth)} for the first graph x {self.graphs})")
        self.log.info("%s graphs need %s", self.what, estimate)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"estimate {human_bytes(total)}")
