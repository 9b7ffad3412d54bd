"""Both prefill runners on real CUDA graphs: segments share one pool, output matches eager."""

from __future__ import annotations

import pytest
import torch

from prefill_cases import against_eager, make_prefill_runner, mixed_batches

from graphslot.reference import TinyConfig
from graphslot.graphs.cuda import CudaGraphWrapper

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

@pytest.mark.parametrize("name", ["breakable", "piecewise"])
@pytest.mark.parametrize("config", [TinyConfig(), TinyConfig(sliding_window=4, swa_layers=(0,))],
                         ids=["full", "swa"])
def test_prefill_on_cuda_graphs_matches_eager(name, config):
    rt, _, runner = make_prefill_runner(config, capture=name, device="cuda")
    assert runner.backend.name == "cuda"
    layers = rt.config.num_layers
    pools = set()
    for graph in runner.graphs.values():
        assert (graph.num_segments, graph.num_eager_steps) == (layers + 1, layers)
        assert all(isinstance(s, CudaGraphWrapper) for s in graph.segments)
        pools.update(id(s.pool) for s in graph.segments)
    assert len(pools) == 1, "every segment of every bucket draws on the backend's one pool"
    used = against_eager(rt, runner, mixed_batches(rt, max_len=10))
    assert {b for _, b in used} == set(runner.buckets)
