"""Graph backends: capture a callable once, replay it on the same memory.

Two backends share one protocol so that runners are written once and tested
without a GPU:

* ``cuda`` (:mod:`graphslot.graphs.cuda`): ``torch.cuda.CUDAGraph``.
* ``cpu`` (:mod:`graphslot.graphs.tape`): a recorded tape of ATen ops with
  CUDA-graph semantics (fixed addresses, frozen Python control flow, no host
  syncs or data-dependent shapes during capture).

Every graph a backend captures goes into its memory pool (``backend.pool``): one
the backend makes, or the engine's handle (:func:`graph_pool`), shared by every backend
given it -- decode and prefill runners of one process alike. ``release()`` gives the
backend's own pool memory back once its graphs are dropped.

The protocols are the whole contract between backends and their callers:

* :class:`GraphBackend`: ``capture(fn)`` runs ``fn`` into a :class:`Graph`;
  ``begin_capture()`` opens an :class:`OpenCapture` while Python code runs on, whose
  ``end(output)`` returns the graph (``abort()`` abandons it): the breakable capture cuts
  one run of a model into segments with it;
* :class:`Graph`: ``replay()`` and the ``output`` it rewrites in place (the shipped
  backends count every replay of their graphs in ``backend.replays``: a test sees that a
  graph ran, not the runner's word for it);
* :class:`InspectableGraph`: a graph that can also list the tensors it reads that
  nothing keeps current (``external_inputs``); the tape's graphs can, CUDA graphs cannot.
  Callers test ``isinstance(graph, InspectableGraph)``.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Iterable, List, Protocol, runtime_checkable

import torch

BACKEND_NAMES = ("auto", "cuda", "cpu")


class GraphCaptureError(RuntimeError):
    """Something in the captured callable cannot be put into a graph."""


@runtime_checkable
class Graph(Protocol):
    #: What the captured callable returned during capture; replay rewrites
    #: these tensors in place.
    output: Any

    def replay(self) -> None: ...


@runtime_checkable
class InspectableGraph(Graph, Protocol):
    """A graph that knows which tensors it reads and which memory is its own."""

    #: Data pointers of the storages the graph allocates or writes: its own memory,
    #: never a stale input.
    produced: AbstractSet[int]

    def external_inputs(self, statics: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """Tensors the graph reads that it neither made nor was told (``statics``) are
        kept current: on a GPU, addresses baked in at capture."""
        ...


@runtime_checkable
class OpenCapture(Protocol):
    """A capture in progress (:meth:`GraphBackend.begin_capture`)."""

    def end(self, output: Any) -> Graph:
        """Close the capture; the graph replays what ran since it began, ``output``
        being what replay rewrites."""
        ...

    def abort(self) -> None:
        """Abandon the capture (after an error); no graph is made."""
        ...


@runtime_checkable
class GraphBackend(Protocol):
    """A graph backend. It also has ``pool``: the memory pool every graph it captures goes
    into (an opaque token on the tape; backends given the same handle share it). That is
    not a protocol member because ``isinstance`` would evaluate it, and a CUDA pool is
    made on first use."""

    name: str

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1, stream: Any = None) -> Graph:
        """``warmup`` eager calls of ``fn``, then one captured call, as a graph.
        ``stream``: the stream to capture on (the engine's capture stream); None: the
        backend's choice. Callers pass it only when they have one."""
        ...

    def begin_capture(self, stream: Any = None) -> OpenCapture:
        """Start capturing now, on this backend's pool (and ``stream``, as
        :meth:`capture`); the caller ends or aborts it."""
        ...

    def release(self) -> None:
        """The graphs are dropped: give the pool's memory back (the backend's own pool
        only; a pool it was given is its owner's to empty)."""
        ...


@runtime_checkable
class WarmsUp(Protocol):
    """A backend that runs warm-ups itself (the CUDA backend: on its capture stream, so
    lazy inits happen on the stream the graphs use). Others' warm-ups are plain calls
    (:func:`~graphslot.graphs.util.warm_up`)."""

    def warm_up(self, fn: Callable[[], Any], times: int, stream: Any = None) -> None: ...


def graph_pool(device: torch.device | str) -> Any:
    """A new graph pool handle for ``device``, to share across backends and runners
    (``graph_pool=``): ``torch.cuda.graph_pool_handle()`` on a CUDA device, an opaque
    token on the CPU tape."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()
    from .tape import TapePool

    return TapePool()


def _has_pool(backend: Any) -> bool:
    return hasattr(type(backend), "pool") or "pool" in getattr(backend, "__dict__", {})


def backend_name(backend: Any, device: torch.device | str) -> str:
    """The name of the backend ``backend`` (a name, ``"auto"`` or a backend object) gives on ``device``."""
    if not isinstance(backend, str):
        return backend.name
    return ("cuda" if torch.device(device).type == "cuda" else "cpu") if backend == "auto" else backend


def get_graph_backend(name: Any, device: torch.device | str, *, pool: Any = None) -> GraphBackend:
    """A new backend capturing into ``pool`` (None: a pool of its own); ``"auto"`` picks
    ``cuda`` for CUDA devices, else ``cpu``. A backend object is returned as it is (its
    pool must then be ``pool``, if one is given)."""
    if not isinstance(name, str):
        if not isinstance(name, GraphBackend) or not _has_pool(name):
            raise TypeError(f"graph backend {name!r} is neither a name ({', '.join(BACKEND_NAMES)}) nor an object "
                            "with the GraphBackend protocol (name, pool, capture, begin_capture, release)")
        if pool is not None and name.pool is not pool:
            raise ValueError(f"graph_pool= differs from the pool of the graph backend given ({name.name!r}): "
                             "give the pool to the backend, or a backend name")
        return name
    device = torch.device(device)
    name = backend_name(name, device)
    # Imported here: both modules import GraphCaptureError from this one.
    if name == "cuda":
        from .cuda import CudaGraphBackend

        return CudaGraphBackend(device, pool=pool)
    if name == "cpu":
        from .tape import TapeBackend

        return TapeBackend(pool=pool)
    raise ValueError(
        f"unknown graph backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}"
    )
