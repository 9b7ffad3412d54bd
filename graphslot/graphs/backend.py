"""Graph backends: capture a callable once, replay it on the same memory.

Two backends share one protocol so that runners are written once and tested
without a GPU:

* ``cuda`` (:mod:`graphslot.graphs.cuda`): ``torch.cuda.CUDAGraph``.
* ``cpu`` (:mod:`graphslot.graphs.tape`): a recorded tape of ATen ops with
  CUDA-graph semantics (fixed addresses, frozen Python control flow, no host
  syncs or data-dependent shapes during capture).

A backend instance owns the memory pool shared by every graph it captures, so
a runner keeps one backend for all its batch sizes.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

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
class GraphBackend(Protocol):
    name: str

    def capture(self, fn: Callable[[], Any], *, warmup: int = 1) -> Graph: ...

    # Backends also offer ``begin_capture()``: a capture left open while Python code
    # runs on, whose ``end(output)`` returns the Graph (``abort()`` abandons it). The
    # breakable runner cuts one run of a model into segments with it.


def get_graph_backend(name: str, device: torch.device | str) -> GraphBackend:
    """A new backend; ``"auto"`` picks ``cuda`` for CUDA devices, else ``cpu``."""
    device = torch.device(device)
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "cpu"
    # Imported here: both modules import GraphCaptureError from this one.
    if name == "cuda":
        from graphslot.graphs.cuda import CudaGraphBackend

        return CudaGraphBackend(device)
    if name == "cpu":
        from graphslot.graphs.tape import TapeBackend

        return TapeBackend()
    raise ValueError(
        f"unknown graph backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)}"
    )
