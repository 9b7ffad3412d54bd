"""The ``cuda`` graph backend: real CUDA graphs sharing one memory pool."""

from __future__ import annotations

import gc

import pytest
import torch

from graphslot.graphs.cuda import CudaGraphBackend, CudaGraphWrapper
from graphslot.graphs.backend import get_graph_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def make_mlp(batch: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).cuda()
    x = torch.zeros(batch, 16, device="cuda")
    return model, x


@torch.inference_mode()
def test_capture_and_replay_match_eager():
    backend = get_graph_backend("auto", "cuda")
    assert isinstance(backend, CudaGraphBackend) and not backend.fresh_cublas_workspace
    model, x = make_mlp(4)
    calls = []

    def fn():
        calls.append(1)
        return torch.softmax(model(x), dim=-1)

    graph = backend.capture(fn, warmup=2)
    assert isinstance(graph, CudaGraphWrapper) and graph.pool is backend.pool
    assert len(calls) == 3
    out, ptr = graph.output, graph.output.data_ptr()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert graph.output is out and out.data_ptr() == ptr
        assert len(calls) == 3
        torch.testing.assert_close(out, torch.softmax(model(x), dim=-1))


@pytest.mark.parametrize("engine_froze", [False, True])
def test_capture_leaves_the_collector_as_it_found_it(engine_froze):
    backend = get_graph_backend("cuda", "cuda")
    model, x = make_mlp(4)
    seen = []

    def fn():
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        return model(x)

    if engine_froze:
        gc.freeze()  # an engine's start-up freeze is not ours to undo
    try:
        before = (gc.isenabled(), gc.get_freeze_count())
        with torch.inference_mode():
            backend.capture(fn, warmup=1)
        assert (gc.isenabled(), gc.get_freeze_count()) == before
    finally:
        if engine_froze:
            gc.unfreeze()
    warm, captured = seen
    assert warm[0] and not captured[0], "no automatic collection during capture"
    assert captured[1] > 0


@torch.inference_mode()
def test_graphs_of_one_backend_share_one_pool():
    backend = get_graph_backend("cuda", "cuda")
    model, x = make_mlp(8)
    big = backend.capture(lambda: model(x))  # largest batch first
    small = backend.capture(lambda: model(x[:2]))
    assert backend.pool is not None and big.pool is backend.pool and small.pool is backend.pool
    assert get_graph_backend("cuda", "cuda").pool is not backend.pool  # a new backend, a new pool

    x.copy_(torch.randn_like(x))
    big.replay()
    torch.testing.assert_close(big.output, model(x))
    # The graphs share scratch memory in the pool, but a graph's output is a live
    # allocation: replaying the other graph leaves it alone.
    small.replay()
    torch.testing.assert_close(small.output, model(x[:2]))
    torch.testing.assert_close(big.output, model(x))


@torch.inference_mode()
def test_graphs_survive_a_cublas_workspace_clear():
    """torch.compile(mode="reduce-overhead") clears cuBLAS's workspaces before each
    recording; a graph that baked in the warm-up's workspace would then write into freed
    memory (seen on an H100: an illegal address at the next replay, with an HF model).
    An engine sharing its process with CUDAGraph Trees asks for a fresh workspace."""
    backend = CudaGraphBackend("cuda", fresh_cublas_workspace=True)
    x = torch.randn(64, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    graph = backend.capture(lambda: x @ w, warmup=1)
    expected = (x @ w).clone()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    # Memory the freed workspace may come back as: a matmul writing into it would show.
    bystanders = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(graph.output, expected)
    assert all(bool((b == 7.0).all()) for b in bystanders)


def test_one_backend_captures_one_workspace_so_a_replay_leaves_other_graphs_outputs_alone():
    """The workspace is made fresh at a backend's first capture only: made fresh at every
    capture, each graph's workspace would return to the pool, where a later capture can
    put its output -- which the earlier graph's replay then overwrites."""
    backend = CudaGraphBackend("cuda", fresh_cublas_workspace=True)
    x = torch.randn(256, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    graphs = [backend.capture(lambda n=n: x[:n] @ w, warmup=1) for n in (256, 128, 64, 32)]
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    expected = [g.output.clone() for g in graphs]
    torch._C._cuda_clearCublasWorkspaces()  # as torch.compile's CUDAGraph Trees does
    torch.cuda.empty_cache()
    for g in reversed(graphs):  # each replay may only write its own output
        g.replay()
    graphs[0].replay()
    torch.cuda.synchronize()
    for g, want in zip(graphs, expected):
        assert torch.equal(g.output, want)
