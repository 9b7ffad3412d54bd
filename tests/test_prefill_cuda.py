"""Both prefill runners on real CUDA graphs: segments share one pool, output matches eager."""

from __future__ import annotations

import pytest
import torch

from prefill_cases import against_eager, make_prefill_runner, mixed_batches

from graphslot.reference import TinyConfig
from graphslot.reference.piecewise_ops import PiecewiseReferencePrefillAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners.breakable import BreakableGraphRunner
from graphslot.graphs.cuda import CudaGraphWrapper
from graphslot.runners.piecewise import PiecewiseGraphRunner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RUNNERS = {
    "breakable": (BreakableGraphRunner, ReferencePrefillAdapter),
    "piecewise": (PiecewiseGraphRunner, PiecewiseReferencePrefillAdapter),
}


@pytest.mark.parametrize("name", sorted(RUNNERS))
@pytest.mark.parametrize("config", [TinyConfig(), TinyConfig(sliding_window=4, swa_layers=(0,))],
                         ids=["full", "swa"])
def test_prefill_on_cuda_graphs_matches_eager(name, config):
    runner_cls, adapter_cls = RUNNERS[name]
    rt, _, runner = make_prefill_runner(config, runner_cls=runner_cls, adapter_cls=adapter_cls, device="cuda")
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
