"""Capture helpers that are not specific to one backend: the CUDA backend and the
runners that capture several graphs in a row use them alike."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional

from .backend import WarmsUp


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection while a graph is captured: a collection walks every Python
    object (slow) and may run finalizers that call into CUDA mid-capture.

    What exists now is frozen, so that a collection someone forces anyway stays cheap,
    unless the process froze objects itself (engines do, at start-up): ``gc.unfreeze``
    cannot tell our objects from theirs, so then automatic collection is only paused.
    """
    gc.collect()
    owns_freeze = gc.get_freeze_count() == 0
    if owns_freeze:
        gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if owns_freeze:
            gc.unfreeze()


def entered(factory: Optional[Callable[[], ContextManager[Any]]]) -> contextlib.ExitStack:
    """An exit stack holding ``factory()`` entered (nothing when ``factory`` is None): the
    engine's capture context, around one graph or segment; ``with`` it, or ``close()`` it."""
    stack = contextlib.ExitStack()
    if factory is not None:
        stack.enter_context(factory())
    return stack


def stream_kwargs(stream: Any) -> Dict[str, Any]:
    """``{"stream": stream}``, or nothing for None: a backend written before ``stream=``
    was part of the protocol is still called as it was."""
    return {} if stream is None else {"stream": stream}


def warm_up(backend: Any, fn: Callable[[], Any], times: int, stream: Any = None) -> None:
    """``times`` eager calls of ``fn`` before a capture: by the backend when it
    :class:`~graphslot.graphs.backend.WarmsUp` (on ``stream``), else plain calls."""
    if isinstance(backend, WarmsUp):
        backend.warm_up(fn, times, **stream_kwargs(stream))
        return
    for _ in range(times):
        fn()
