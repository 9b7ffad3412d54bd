"""The CUDA backend's cuBLAS-workspace policy, checked without a GPU (the capture itself
is replaced; tests/test_cuda_graph.py checks the effect on one): no process-global state
changes unless the engine asks (``fresh_cublas_workspace=True``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import graphslot.graphs.cuda as cuda_graph
from graphslot.graphs import get_graph_backend


def captures(monkeypatch, backends):
    """``(graph, fresh_workspace)`` for each capture ``backends`` (``(backend, graph)`` pairs) open."""
    seen = []

    @contextlib.contextmanager
    def recording(graph, pool, stream, *, fresh_workspace):
        seen.append((graph, fresh_workspace))
        yield

    monkeypatch.setattr(cuda_graph, "capturing", recording)
    for backend, graph in backends:
        with backend._capturing(graph, None):
            pass
    return seen


def test_the_workspace_is_left_alone_unless_asked(monkeypatch):
    # What every runner makes from a backend name: no global change.
    first, second = get_graph_backend("cuda", "cuda"), get_graph_backend("auto", "cuda:0")
    assert not first.fresh_cublas_workspace and not second.fresh_cublas_workspace
    seen = captures(monkeypatch, ((first, "a"), (first, "b"), (second, "c")))
    assert seen == [("a", False), ("b", False), ("c", False)]


def test_asked_the_workspace_is_made_fresh_at_a_backends_first_capture_only(monkeypatch):
    first = cuda_graph.CudaGraphBackend("cuda", fresh_cublas_workspace=True)
    second = cuda_graph.CudaGraphBackend("cuda", fresh_cublas_workspace=True)
    seen = captures(monkeypatch, ((first, "a"), (first, "b"), (second, "c"), (first, "d"), (second, "e")))
    assert seen == [("a", True), ("b", False), ("c", True), ("d", False), ("e", False)]
    first.release()  # its graphs dropped: the next capture makes a fresh workspace again
    assert captures(monkeypatch, ((first, "f"),)) == [("f", True)]


@pytest.mark.parametrize("fresh", [False, True])
def test_capturing_clears_the_workspaces_only_when_fresh(monkeypatch, fresh):
    clears = []
    # CPU builds lack it
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: clears.append(1), raising=False)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool, stream: contextlib.nullcontext())
    with cuda_graph.capturing(None, None, None, fresh_workspace=fresh):
        pass
    assert len(clears) == int(fresh)
