"""The prefill runner under capture="breakable": graph segments between eager attention steps, exact."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from prefill_cases import (
    BUCKETS,
    against_eager,
    agreement_with_a_twin,
    assert_falls_back_to_eager,
    make_prefill_runner,
    mixed_batches,
    replay_metadata_calls,
)

from graphslot.reference import TinyConfig, build_reference_model, make_extend_batch
from graphslot.reference.graph_attention import install_graph_attention, reference_attention
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners.breakable import capture_breakable, eager_on_graph, is_eager_on_graph
from graphslot.graphs.backend import GraphCaptureError
from graphslot.runners.prefill import PrefillGraphRunner, default_token_buckets, token_buckets
from graphslot.graphs.segments import EagerStep
from graphslot.runners.prefill_adapter import LayerStackError
from graphslot.graphs.tape import TapeBackend

make_runner = functools.partial(make_prefill_runner, capture="breakable")


# ------------------------------------------------------------------- graph == eager


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_prefill_equals_eager_across_buckets_and_padding(mode):
    rt, _, runner = make_runner(impl=mode)
    assert runner.buckets == [64, 32, 16] and runner.registry.impl == mode
    used = against_eager(rt, runner, mixed_batches(rt, max_len=10))
    assert {b for _, b in used} == set(BUCKETS)
    assert any(n < b for n, b in used), "no batch needed token padding"


def test_one_graph_serves_every_batch_size_of_a_bucket():
    rt, _, runner = make_runner(token_buckets=[32])
    graph = runner.graphs[32]
    used = against_eager(rt, runner, mixed_batches(rt, seed=3, max_len=4))
    assert {b for _, b in used} == {32} and runner.graphs[32] is graph


def test_exact_bucket_fit_and_default_schedule():
    rt, _, runner = make_runner(token_buckets=None, max_num_tokens=40)
    assert runner.buckets == sorted(default_token_buckets(40) + [40], reverse=True)
    rpi = rt.req_to_token_pool.alloc(5)
    fb = make_extend_batch(rt, rpi, [0] * 5, [[i + 1] * 8 for i in range(5)])  # 40 tokens
    assert runner.bucket(fb) == 40
    against_eager(rt, runner, [fb])
    fb = make_extend_batch(rt, rt.req_to_token_pool.alloc(1), [0], [[3, 4, 5]])
    assert runner.bucket(fb) == 4
    against_eager(rt, runner, [fb])


def test_sliding_window_model():
    config = TinyConfig(sliding_window=4, swa_layers=(0,))
    rt, _, runner = make_runner(config)
    assert runner.registry.has_slot("out_cache_loc_swa")
    against_eager(rt, runner, mixed_batches(rt, seed=5, sizes=(1, 3, 4, 8)))


# ------------------------------------------------------------- segments and steps


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_attention_breaks_split_the_stack(num_layers):
    rt, _, runner = make_runner(TinyConfig(num_layers=num_layers), token_buckets=[16])
    graph = runner.graphs[16]
    assert graph.num_eager_steps == num_layers
    assert graph.num_segments == num_layers + 1
    # Segments and eager steps alternate, starting and ending with a segment.
    kinds = [isinstance(s, EagerStep) for s in graph.steps]
    assert kinds == [i % 2 == 1 for i in range(2 * num_layers + 1)]
    assert all(s.name.endswith("reference_attention") for s in graph.eager_steps)
    assert all(len(seg.ops) > 0 for seg in graph.segments)
    against_eager(rt, runner, mixed_batches(rt, sizes=(2, 5), max_len=3))


def test_segments_read_nothing_stale():
    _, _, runner = make_runner(token_buckets=[16])
    assert runner.external_inputs(16) == []


def test_without_breaks_the_extend_attention_is_not_graph_safe():
    # The same stack captured whole bakes in the capture's metadata (no eager step):
    # exactly what the breaks are for.
    rt = build_reference_model(max_num_reqs=16)
    adapter = ReferencePrefillAdapter(rt, install_attention=False)
    runner = PrefillGraphRunner(adapter, capture="breakable", token_buckets=[16], progress=False)
    assert runner.graphs[16].num_segments == 1 and runner.graphs[16].num_eager_steps == 0


# ------------------------------------------------------------- the metadata hook


class CaptureOnlyHookRunner(PrefillGraphRunner):
    """A buggy runner: attention metadata written at capture, never on replay."""

    def prepare_replay(self, n, view, fb):
        pass


def test_metadata_hook_runs_on_every_replay():
    rt, adapter, runner = make_runner()
    calls, expected = replay_metadata_calls(rt, adapter, runner)
    assert calls == expected


@pytest.mark.parametrize("runner_cls", [PrefillGraphRunner, CaptureOnlyHookRunner])
def test_a_capture_only_metadata_hook_gives_wrong_output(runner_cls):
    # One bucket, so the capture's metadata has the right shape: the output is silently wrong.
    rt, _, runner = make_runner(runner_cls=runner_cls, token_buckets=[32])
    same = agreement_with_a_twin(rt, runner)
    if runner_cls is PrefillGraphRunner:
        assert all(same)
    else:
        assert not any(same), "skipping the replay metadata hook went unnoticed"


# ----------------------------------------------------------------------- errors


def test_missing_layer_stack_is_a_clear_error():
    class NoStack(ReferencePrefillAdapter):
        def layer_stack(self, model):
            raise NotImplementedError

    with pytest.raises(LayerStackError, match=r"NoStack must implement layer_stack\(model\).*does not guess"):
        make_runner(adapter_cls=NoStack)


def test_a_module_list_is_not_a_layer_stack():
    class ListStack(ReferencePrefillAdapter):
        def layer_stack(self, model):
            return model.layers

    with pytest.raises(LayerStackError, match="ModuleList.*no forward"):
        make_runner(adapter_cls=ListStack)


def test_host_sync_inside_a_segment_names_the_op():
    class SyncingStack(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, positions, hidden, fb):
            hidden = self.inner.layers[0](positions, hidden, fb)
            if hidden.sum().item() > 1e30:  # a host sync in the dense part after attention 0
                hidden = hidden * 2
            return self.inner.layers[1](positions, hidden, fb)

    class Syncing(ReferencePrefillAdapter):
        def layer_stack(self, model):
            return SyncingStack(super().layer_stack(model))

    with pytest.raises(GraphCaptureError) as info:
        make_runner(adapter_cls=Syncing, token_buckets=[16])
    msg = str(info.value)
    assert "aten._local_scalar_dense" in msg and ".item()" in msg
    assert "token bucket 16" in msg and "segment 1" in msg and "reference_attention" in msg


def test_batch_beyond_the_largest_bucket_falls_back_to_eager():
    rt, _, runner = make_runner(token_buckets=[8, 16], max_bs=4)
    assert_falls_back_to_eager(rt, runner)


# ------------------------------------------------------------- the break itself


def test_capture_breakable_on_the_tape():
    calls = []

    @eager_on_graph
    def host_side(x):  # would not be capturable: reads a value on the host
        calls.append(float(x.sum()))
        return x * float(x.sum())

    x = torch.tensor([1.0, 2.0])

    def fn():
        return host_side(x + 1) - 1

    graph = capture_breakable(TapeBackend(), fn, warmup=1)
    assert (graph.num_segments, graph.num_eager_steps) == (2, 1)
    assert torch.equal(graph.output, torch.tensor([9.0, 14.0]))
    x.copy_(torch.tensor([0.0, 1.0]))
    graph.replay()
    assert torch.equal(graph.output, torch.tensor([2.0, 5.0]))  # (x+1) * 3 - 1
    assert len(calls) == 3  # warm-up, capture, replay
    assert is_eager_on_graph(host_side) and is_eager_on_graph(reference_attention)


def test_eager_on_graph_is_a_plain_call_outside_a_capture():
    rt = build_reference_model(max_num_reqs=8)
    rpi = rt.req_to_token_pool.alloc(2)
    fb = make_extend_batch(rt, rpi, [0, 0], [[1, 2, 3], [4, 5]])
    before = rt.forward(fb)
    assert install_graph_attention(rt.model) == rt.config.num_layers
    assert install_graph_attention(rt.model) == rt.config.num_layers  # idempotent
    assert torch.equal(rt.forward(fb), before)


def test_token_buckets():
    assert default_token_buckets(64) == [4, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    assert token_buckets(50) == [50, 48, 32, 28, 24, 20, 16, 12, 8, 4]
    assert token_buckets(50, [16, 8, 16]) == [16, 8]
    with pytest.raises(ValueError):
        token_buckets(2, [])
