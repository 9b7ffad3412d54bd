"""The CUDA backend's cuBLAS-workspace policy, checked without a GPU (the capture itself
is replaced; tests/test_cuda_graph.py checks the effect on one)."""

from __future__ import annotations

import contextlib

import graphslot.graphs.cuda as cuda_graph


def test_the_workspace_is_made_fresh_at_a_backends_first_capture_only(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def recording(graph, pool, stream, *, fresh_workspace):
        seen.append((graph, fresh_workspace))
        yield

    monkeypatch.setattr(cuda_graph, "capturing", recording)
    first, second = cuda_graph.CudaGraphBackend("cuda"), cuda_graph.CudaGraphBackend("cuda")
    for backend, graph in ((first, "a"), (first, "b"), (second, "c"), (first, "d"), (second, "e")):
        with backend._capturing(graph):
            pass
    assert seen == [("a", True), ("b", False), ("c", True), ("d", False), ("e", False)]
