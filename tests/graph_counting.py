"""Tests see the graph run: a graph backend that counts the replays of every graph it
captures, whatever the capture mode (a full graph, a breakable run's segments, a
piecewise run's pieces).

The count is the graphs' own, not the runner's: a runner that runs a step eager while
counting it as a replay (or captures nothing at all) leaves it unchanged. Give a runner
``backend=CountingBackend()`` (the CPU tape) or ``CountingBackend(inner)``, and assert
with :func:`replays_one_step` (or read :attr:`CountingBackend.replays`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from graphslot.graphs.backend import GraphBackend, get_graph_backend


class CountedGraph:
    """A captured graph whose ``replay()`` is counted on its backend; everything else
    (``output``, ``external_inputs``, ``produced`` ...) is the graph's."""

    def __init__(self, graph: Any, backend: "CountingBackend"):
        self._graph = graph
        self._backend = backend

    def replay(self) -> None:
        self._backend.replays += 1
        self._graph.replay()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)


class _CountedCapture:
    def __init__(self, open_capture: Any, backend: "CountingBackend"):
        self._open = open_capture
        self._backend = backend

    def end(self, output: Any) -> CountedGraph:
        self._backend.captures += 1
        return CountedGraph(self._open.end(output), self._backend)

    def abort(self) -> None:
        self._open.abort()


class CountingBackend:
    """A graph backend (``inner``, default the CPU tape) counting what it captures and
    every replay of those graphs."""

    def __init__(self, inner: Optional[GraphBackend] = None):
        self.inner = inner if inner is not None else get_graph_backend("cpu", "cpu")
        self.name = self.inner.name
        #: Graphs (segments, pieces) captured, and replays of any of them.
        self.captures = 0
        self.replays = 0

    @property
    def pool(self) -> Any:
        return self.inner.pool

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1, stream: Any = None) -> CountedGraph:
        graph = self.inner.capture(fn, warmup=warmup, stream=stream)
        self.captures += 1
        return CountedGraph(graph, self)

    def begin_capture(self, stream: Any = None) -> _CountedCapture:
        return _CountedCapture(self.inner.begin_capture(stream), self)

    def release(self) -> None:
        self.inner.release()


def counting(runner: Any) -> CountingBackend:
    """``runner``'s backend, checked to be a :class:`CountingBackend`."""
    backend = runner.backend
    assert isinstance(backend, CountingBackend), f"{runner!r} was not given backend=CountingBackend()"
    return backend


@contextlib.contextmanager
def replays_one_step(runner: Any) -> Iterator[None]:
    """Asserts that the step run inside replayed at least one captured graph of
    ``runner``'s backend (counted by the graphs, not the runner)."""
    backend = counting(runner)
    before = backend.replays
    yield
    assert backend.replays > before, f"the step ran no captured graph of {runner!r}: it ran eager"


def unwrap(graph: Any) -> Any:
    """The backend's own graph behind a :class:`CountedGraph` (anything else as it is)."""
    return graph._graph if isinstance(graph, CountedGraph) else graph


def counting_backend(device: Any = "cpu", backend: Any = "auto", pool: Any = None) -> CountingBackend:
    """A :class:`CountingBackend` over ``backend`` (a name, as a runner's ``backend=``) on
    ``device``, capturing into ``pool``."""
    return CountingBackend(get_graph_backend(backend, device, pool=pool))
