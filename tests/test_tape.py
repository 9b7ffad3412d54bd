"""The ``cpu`` graph backend behaves like a CUDA graph, on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphslot.graphs.backend import GraphCaptureError, get_graph_backend
from graphslot.graphs.tape import TapeBackend, TapeGraph


def capture(fn, warmup=1) -> TapeGraph:
    return TapeBackend().capture(fn, warmup=warmup)


# -- choosing a backend ---------------------------------------------------------------------


def test_auto_picks_cpu_for_a_cpu_device():
    assert get_graph_backend("auto", "cpu").name == "cpu"
    assert get_graph_backend("auto", torch.device("cpu")).name == "cpu"
    assert isinstance(get_graph_backend("cpu", "cpu"), TapeBackend)


def test_cuda_backend_is_built_without_touching_cuda():
    assert get_graph_backend("auto", "cuda:0").name == "cuda"
    assert get_graph_backend("cuda", "cuda").name == "cuda"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_graph_backend("cuda", "cpu")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown graph backend 'tpu'.*auto, cuda, cpu"):
        get_graph_backend("tpu", "cpu")


# -- replay recomputes on the static inputs --------------------------------------------------


def test_mlp_replay_matches_eager_bit_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)  # static input buffer

    def fn():
        return torch.softmax(model(x) @ torch.eye(4) * 0.5, dim=-1)

    with torch.no_grad():
        graph = capture(fn)
        out = graph.output
        for _ in range(3):
            x.copy_(torch.randn(3, 8))
            graph.replay()
            assert graph.output is out
            assert torch.equal(out, fn())


def test_indexing_scatter_and_kv_cache_writes_replay():
    torch.manual_seed(0)
    vocab, dim, slots, batch = 11, 4, 16, 3
    embedding = torch.randn(vocab, dim)
    w = torch.randn(dim, dim)
    statics = {
        "tokens": torch.zeros(batch, dtype=torch.long),
        "slot_mapping": torch.zeros(batch, dtype=torch.long),
        "positions": torch.zeros(batch, dtype=torch.long),
        "cache": torch.zeros(slots, dim),
    }

    def step(s):
        h = embedding.index_select(0, s["tokens"])
        k = h @ w
        s["cache"].index_put_((s["slot_mapping"],), k)  # cache[slot_mapping] = k
        s["cache"][0].add_(1.0)  # in place through a view
        ctx = s["cache"].t()[:, :batch].t()  # views of the cache
        picked = s["cache"][s["slot_mapping"]]  # integer indexing is fine
        rows = torch.gather(ctx, 1, s["positions"].unsqueeze(1).expand(-1, dim))
        gated = torch.where(s["positions"].unsqueeze(1) > 0, picked, -picked)
        return torch.cat([gated, rows.contiguous(), h[:, :2]], dim=1)

    graph = capture(lambda: step(statics))
    for i in range(3):
        new = {
            "tokens": torch.randint(vocab, (batch,)),
            "slot_mapping": torch.randperm(slots)[:batch],
            "positions": torch.randint(4, (batch,)),
        }
        for name, value in new.items():
            statics[name].copy_(value)
        before = {name: t.clone() for name, t in statics.items()}
        graph.replay()
        expected = step(before)
        assert torch.equal(graph.output, expected), f"replay {i}"
        assert torch.equal(statics["cache"], before["cache"])  # step() updated the clone


def test_replay_runs_the_tape_not_the_function():
    calls = []
    x = torch.ones(2)

    def fn():
        calls.append(1)
        return x * 2

    graph = capture(fn, warmup=0)
    graph.replay()
    graph.replay()
    assert len(calls) == 1


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_warmup_runs_before_capture(warmup):
    calls = []
    x = torch.ones(1)
    graph = capture(lambda: calls.append(1) or x + 1, warmup=warmup)
    assert len(calls) == warmup + 1
    assert graph.ops == ["aten.add.Tensor"]


def test_views_are_recorded_but_not_replayed():
    x = torch.arange(6.0).reshape(2, 3)
    graph = capture(lambda: (x.t()[1:] + 1).t())
    assert graph.ops == ["aten.t.default", "aten.slice.Tensor", "aten.add.Tensor", "aten.t.default"]
    assert graph.num_replay_ops == 1
    x.mul_(10)
    graph.replay()
    assert torch.equal(graph.output, (x.t()[1:] + 1).t())


def test_multi_output_ops_write_every_output():
    x = torch.randn(4, 5)
    graph = capture(lambda: (x.max(dim=1), torch.topk(x, 2)))
    x.copy_(torch.randn(4, 5))
    graph.replay()
    (values, indices), (top, top_idx) = graph.output
    assert torch.equal(values, x.max(dim=1).values) and torch.equal(indices, x.max(dim=1).indices)
    assert torch.equal(top, torch.topk(x, 2).values) and torch.equal(top_idx, torch.topk(x, 2).indices)


def test_in_place_reshaping_of_a_result_keeps_earlier_ops_shapes():
    # F.linear on 1-D input without bias runs mm on a (1, n) view, then squeeze_
    # on the result: replaying mm must still write a (1, n) result.
    w = torch.randn(2, 3)
    x = torch.randn(3)
    graph = capture(lambda: F.linear(x, w) * 1)
    assert "aten.squeeze_.dim" in graph.ops
    x.copy_(torch.randn(3))
    graph.replay()
    assert torch.equal(graph.output, F.linear(x, w))


def test_capture_with_grad_enabled_and_under_inference_mode():
    lin = nn.Linear(4, 4)  # parameters require grad
    x = torch.randn(2, 4)
    graph = capture(lambda: lin(x).relu())
    x.copy_(torch.randn(2, 4))
    graph.replay()
    assert torch.equal(graph.output.detach(), lin(x).relu().detach())

    with torch.inference_mode():
        y = torch.randn(2, 4)
        graph = capture(lambda: lin(y).relu())
    with torch.inference_mode():  # inference tensors are written inside the mode
        y.copy_(torch.randn(2, 4))
    graph.replay()
    with torch.inference_mode():
        assert torch.equal(graph.output, lin(y).relu())


def test_tensors_and_scalars_made_inside_capture_are_reset_each_replay():
    x = torch.ones(3)

    def fn():
        acc = torch.zeros(3)  # a device allocation: zero-filled on every replay
        acc[0] = 5.0  # a 0-dim host scalar: a constant of the graph
        acc.add_(x)
        return acc

    graph = capture(fn)
    graph.replay()
    graph.replay()
    assert torch.equal(graph.output, torch.tensor([6.0, 1.0, 1.0]))


def test_random_ops_draw_again_on_replay():
    x = torch.zeros(1000)
    graph = capture(lambda: x + torch.rand(1000))
    first = graph.output.clone()
    graph.replay()
    assert not torch.equal(graph.output, first)
    assert 0 <= graph.output.min() and graph.output.max() < 1


# -- addresses and Python values are frozen at capture -------------------------------------


def test_output_and_intermediates_keep_their_addresses():
    x = torch.randn(4, 4)
    seen = []

    def fn():
        h = x @ x
        seen.append(h)
        return torch.relu(h + 1)

    graph = capture(fn, warmup=0)
    h, out = seen[0], graph.output
    ptrs = (h.data_ptr(), out.data_ptr())
    for _ in range(3):
        x.copy_(torch.randn(4, 4))
        graph.replay()
        assert (h.data_ptr(), out.data_ptr()) == ptrs
        assert torch.equal(h, x @ x)
        assert torch.equal(out, torch.relu(x @ x + 1))


def test_python_control_flow_is_frozen_at_capture():
    x = torch.ones(2)
    flags = {"double": False}
    graph = capture(lambda: x * 2 if flags["double"] else x + 1)
    flags["double"] = True
    x.fill_(5)
    graph.replay()
    assert torch.equal(graph.output, torch.full((2,), 6.0))  # still x + 1


def test_python_scalars_are_frozen_at_capture():
    x = torch.ones(2)
    params = {"scale": 3}
    graph = capture(lambda: x * float(params["scale"]))
    params["scale"] = 100
    graph.replay()
    assert torch.equal(graph.output, torch.full((2,), 3.0))


def test_rebinding_a_name_does_not_reach_the_graph():
    state = {"x": torch.ones(2)}
    old = state["x"]
    graph = capture(lambda: state["x"] * 2)
    state["x"] = torch.full((2,), 7.0)  # a new tensor, not a write into the old one
    graph.replay()
    assert torch.equal(graph.output, torch.full((2,), 2.0))
    [external] = graph.external_inputs()  # the address a GPU graph would have baked in
    assert external is old


# -- what a GPU graph cannot capture --------------------------------------------------------

x_sync = torch.tensor([1.0, 0.0, 2.0])


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda: x_sync[0].item(), "aten._local_scalar_dense"),
        (lambda: bool(x_sync[0]), "aten._local_scalar_dense"),
        (lambda: int(x_sync[0]), "aten._local_scalar_dense"),
        (lambda: x_sync * 2 if x_sync.sum() > 0 else x_sync, "aten._local_scalar_dense"),
        (lambda: torch.equal(x_sync, x_sync), "aten.equal"),
        (lambda: x_sync.tolist(), "Tensor.tolist()"),
        (lambda: x_sync.numpy(), "Tensor.numpy()"),
    ],
    ids=["item", "bool", "int", "if", "equal", "tolist", "numpy"],
)
def test_host_sync_is_a_capture_error(fn, op):
    with pytest.raises(GraphCaptureError, match="host sync during graph capture") as err:
        capture(fn, warmup=0)
    assert op in str(err.value)
    assert "keep the value on the device" in str(err.value)


def test_tolist_works_again_after_capture():
    with pytest.raises(GraphCaptureError):
        capture(lambda: x_sync.tolist(), warmup=0)
    assert x_sync.tolist() == [1.0, 0.0, 2.0]
    assert "tolist" not in torch.Tensor.__dict__


def test_a_swallowed_capture_error_still_fails_the_capture():
    def fn():
        try:
            x_sync[0].item()
        except GraphCaptureError:
            pass
        return x_sync + 1

    with pytest.raises(GraphCaptureError, match="aten._local_scalar_dense"):
        capture(fn, warmup=0)


mask = torch.tensor([True, False, True])
index = torch.tensor([2, 0])
counts = torch.tensor([1, 2])


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda: x_sync.nonzero(), "aten.nonzero.default"),
        (lambda: x_sync.masked_select(mask), "aten.masked_select.default"),
        (lambda: torch.unique(x_sync), "aten._unique2.default"),
        (lambda: x_sync[mask], "aten.index.Tensor with a boolean mask"),
        (lambda: x_sync.clone().__setitem__(mask, 0.0), "aten.index_put_.default with a boolean mask"),
        (lambda: torch.repeat_interleave(x_sync.long()), "aten.repeat_interleave.Tensor without output_size"),
    ],
    ids=["nonzero", "masked_select", "unique", "mask-index", "mask-assign", "repeat_interleave"],
)
def test_data_dependent_shape_is_a_capture_error(fn, op):
    with pytest.raises(GraphCaptureError, match="data-dependent output shape") as err:
        capture(fn, warmup=0)
    assert op in str(err.value)


def test_fixed_shape_alternatives_capture_fine():
    graph = capture(lambda: (
        torch.where(mask, x_sync, 0.0),
        x_sync.masked_fill(~mask, 0.0),
        x_sync[index],
        torch.repeat_interleave(counts, output_size=3),
    ))
    graph.replay()
    assert torch.equal(graph.output[3], torch.tensor([0, 1, 1]))


# -- external inputs ------------------------------------------------------------------------


def test_external_inputs_are_tensors_neither_static_nor_made_by_the_graph():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # declared static (a slot buffer)
    stale = torch.randn(2, 4)  # read but never declared
    stale_view_base = torch.randn(8)

    def fn():
        h = lin(x)  # parameters: static
        h = h + torch.arange(1.0, 5.0)  # allocated and filled by the graph
        return h * stale + stale_view_base.view(2, 4)  # intermediates: made by the graph

    with torch.no_grad():
        graph = capture(fn)
    params = list(lin.parameters())
    found = graph.external_inputs([x, *params])
    assert [t is stale for t in found] == [True, False]
    assert found[1].untyped_storage().data_ptr() == stale_view_base.untyped_storage().data_ptr()
    assert graph.describe_external_inputs([x, *params]) == ["(2, 4) float32", "(8,) float32"]
    assert len(graph.external_inputs([x, stale, stale_view_base])) == 2  # weight, bias
    assert graph.external_inputs([x, stale, stale_view_base[:1], *params]) == []


def test_out_arguments_are_not_inputs_but_in_place_targets_are():
    x = torch.randn(3)
    out = torch.empty(3)
    acc = torch.zeros(3)
    like = torch.zeros(3)  # only its shape is used

    def fn():
        torch.add(x, 1, out=out)
        acc.add_(x)
        return out, torch.empty_like(like).fill_(1)

    graph = capture(fn)
    [external] = graph.external_inputs([x])
    assert external is acc


def test_a_weight_rebound_after_capture_is_an_external_input_the_graph_still_reads():
    lin = nn.Linear(4, 4, bias=False)
    emb = nn.Embedding(6, 4)
    ids = torch.tensor([1, 3])

    with torch.no_grad():
        graph = capture(lambda: lin(emb(ids)))
    params = [lin.weight, emb.weight]
    assert graph.external_inputs([ids, *params]) == []
    old = emb.weight.data
    emb.weight.data = old.clone()  # what the graph reads is no longer the model's weight
    [external] = graph.external_inputs([ids, *params])
    assert external is not emb.weight and external.data_ptr() == old.data_ptr()
