"""Graph backends behind one protocol: CUDA graphs, the CPU tape, segmented graphs.

Nothing here knows of slots or runners. The protocols (:mod:`.backend`) are the whole
contract with callers: :class:`GraphBackend` (``capture``, ``begin_capture``),
:class:`OpenCapture`, :class:`Graph` and :class:`InspectableGraph`.
"""

from .backend import (
    BACKEND_NAMES,
    Graph,
    GraphBackend,
    GraphCaptureError,
    InspectableGraph,
    OpenCapture,
    get_graph_backend,
    graph_pool,
)
from .cuda import CudaGraphBackend
from .segments import EagerStep, SegmentedGraph
from .tape import TapeBackend, TapeGraph, TapePool
from .util import no_collection

__all__ = [
    "BACKEND_NAMES",
    "CudaGraphBackend",
    "EagerStep",
    "Graph",
    "GraphBackend",
    "GraphCaptureError",
    "InspectableGraph",
    "OpenCapture",
    "SegmentedGraph",
    "TapeBackend",
    "TapeGraph",
    "TapePool",
    "get_graph_backend",
    "graph_pool",
    "no_collection",
]
