"""The prefill runner under capture="piecewise": torch.compile split at custom ops, pieces captured, exact."""

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
from graphslot.reference.graph_attention import ATTENTION_OP, GraphAttentionBackend, install_graph_attention
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.graphs.backend import GraphCaptureError
from graphslot.graphs.segments import EagerStep
from graphslot.runners.piecewise import make_graphslot_backend, split_graph
from graphslot.runners.prefill import PrefillGraphRunner, PrefillRunnerConfig

make_runner = functools.partial(make_prefill_runner, capture="piecewise")


@pytest.fixture(scope="module")
def shared():
    """One runner (three buckets, three compiles) for the tests that only replay."""
    return make_runner()


# ------------------------------------------------------------------- graph == eager


def test_prefill_equals_eager_across_buckets_and_padding(shared):
    rt, _, runner = shared
    assert runner.buckets == [64, 32, 16] and runner.capture_mode.split_ops == (ATTENTION_OP,)
    used = against_eager(rt, runner, mixed_batches(rt, max_len=10))
    assert {b for _, b in used} == set(BUCKETS)
    assert any(n < b for n, b in used), "no batch needed token padding"


def test_interpreted_registry_and_one_graph_per_bucket():
    rt, _, runner = make_runner(impl="interpreted", token_buckets=[32])
    assert runner.registry.impl == "interpreted"
    graph = runner.graphs[32]
    used = against_eager(rt, runner, mixed_batches(rt, seed=3, max_len=4))
    assert {b for _, b in used} == {32} and runner.graphs[32] is graph


def test_pieces_read_nothing_stale(shared):
    _, _, runner = shared
    for n in BUCKETS:
        assert runner.external_inputs(n) == []


# ------------------------------------------------------------- pieces and split ops


@pytest.mark.parametrize("num_layers", [1, 3])
def test_split_ops_split_the_stack(num_layers):
    rt, _, runner = make_runner(TinyConfig(num_layers=num_layers), token_buckets=[16])
    graph = runner.graphs[16]
    assert graph.num_eager_steps == num_layers
    assert graph.num_segments == num_layers + 1
    kinds = [isinstance(s, EagerStep) for s in graph.steps]
    assert kinds == [i % 2 == 1 for i in range(2 * num_layers + 1)]
    assert all(s.name == ATTENTION_OP for s in graph.eager_steps)
    assert all(len(p.ops) > 0 for p in graph.segments)
    # One Dynamo graph for the bucket, split the same way.
    (module,) = runner.captured_fn.compiled_modules
    assert (module.num_split_ops, module.num_pieces) == (num_layers, num_layers + 1)
    against_eager(rt, runner, mixed_batches(rt, sizes=(2, 5), max_len=3))


def test_one_trace_and_one_compile_per_piece_for_every_bucket(shared):
    rt, _, runner = shared
    layers = rt.config.num_layers
    assert runner.captured_fn.traces == 1  # the token dimension is symbolic: one trace for the three buckets
    (module,) = runner.captured_fn.compiled_modules
    assert module.compiled_pieces == layers + 1 and runner.captured_fn.compile_backend == "aot_eager"
    for n in BUCKETS:
        assert (runner.graphs[n].num_eager_steps, runner.graphs[n].num_segments) == (layers, layers + 1)


def test_user_declared_split_op():
    # Any custom op can be a split op: it runs eagerly, on the host even.
    calls = []

    @torch.library.custom_op("graphslot_test::host_scale", mutates_args=())
    def host_scale(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * float(x.sum())  # a host read: not capturable

    @host_scale.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(nn.Module):
        def forward(self, x):
            return torch.ops.graphslot_test.host_scale(x + 1) - 1

    from graphslot.runners.piecewise import _Recording, _recording
    from graphslot.graphs.tape import TapeBackend

    compiled_modules = []
    m = torch.compile(M(), backend=make_graphslot_backend(["graphslot_test::host_scale"], compiled_modules),
                      dynamic=False, fullgraph=True)
    x = torch.tensor([1.0, 2.0])
    rec = _Recording(TapeBackend())
    with _recording(rec):
        out = m(x)
    assert torch.equal(out, torch.tensor([9.0, 14.0]))
    assert [type(s).__name__ for s in rec.steps] == ["TapeGraph", "EagerStep", "TapeGraph"]
    x.copy_(torch.tensor([0.0, 1.0]))
    for s in rec.steps:
        s() if isinstance(s, EagerStep) else s.replay()
    assert torch.equal(out, torch.tensor([2.0, 5.0]))  # (x+1) * 3 - 1
    assert compiled_modules[0].num_split_ops == 1
    assert torch.equal(m(x), torch.tensor([2.0, 5.0]))  # no capture pass: a plain run


def test_split_graph_on_a_plain_fx_graph():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Tanh()))
    module = split_graph(gm, ["aten::relu"])  # no op node in a symbolic trace of modules
    assert (module.num_split_ops, module.num_pieces) == (0, 1)


# ------------------------------------------------------------- the metadata hook


class CaptureOnlyHookRunner(PrefillGraphRunner):
    """A buggy runner: attention metadata written at capture, never on replay."""

    def prepare_replay(self, n, view, fb):
        pass


def test_metadata_hook_runs_on_every_replay(shared):
    rt, adapter, runner = shared
    calls, expected = replay_metadata_calls(rt, adapter, runner)
    assert calls == expected


def test_a_capture_only_metadata_hook_gives_wrong_output():
    rt, _, runner = make_runner(runner_cls=CaptureOnlyHookRunner, token_buckets=[32])
    assert not any(agreement_with_a_twin(rt, runner)), "skipping the replay metadata hook went unnoticed"


# ----------------------------------------------------------------------- fallback


def test_batch_beyond_the_largest_bucket_falls_back_to_eager(shared):
    rt, _, runner = shared
    assert_falls_back_to_eager(rt, runner)


# ----------------------------------------------------------------------- errors


def test_no_split_ops_is_a_clear_error():
    class Unsplit(ReferencePrefillAdapter):
        split_ops = None

    with pytest.raises(ValueError, match=r"^capture='piecewise' needs split ops: pass split_ops="):
        PrefillGraphRunner(Unsplit(build_reference_model(max_num_reqs=8)), capture="piecewise", token_buckets=[16],
                           progress=False)


def test_a_mistyped_split_op_is_a_clear_error():
    with pytest.raises(GraphCaptureError) as info:
        make_runner(token_buckets=[16], split_ops=("graphslot_ref::atention",))
    assert str(info.value) == (
        "token bucket 16: none of the split ops ['graphslot_ref::atention'] occurs in the compiled function, "
        "so nothing would run eagerly between pieces; custom ops it calls: graphslot_ref::attention. Name the "
        'op as torch.library registered it ("namespace::name")')


def test_a_graph_break_is_a_clear_error():
    class Breaking(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, positions, hidden, fb):
            hidden = self.inner.layers[0](positions, hidden, fb)
            torch._dynamo.graph_break()
            return self.inner.layers[1](positions, hidden, fb)

    class Adapter(ReferencePrefillAdapter):
        def layer_stack(self, model):
            return Breaking(super().layer_stack(model))

    with pytest.raises(GraphCaptureError, match="token bucket 16: .*2 Dynamo graphs"):
        make_runner(adapter_cls=Adapter, token_buckets=[16])


def test_an_op_that_cannot_be_captured_names_the_bucket_piece_and_op():
    class Syncing(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, positions, hidden, fb):
            hidden = self.inner(positions, hidden, fb)
            return hidden * (hidden.abs().max().item() > 0)  # a host read after the last layer

    class Adapter(ReferencePrefillAdapter):
        def layer_stack(self, model):
            return Syncing(super().layer_stack(model))

    # Dynamo would graph-break on .item(); told to keep it, the read lands in a piece.
    with torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(GraphCaptureError) as info:
        make_runner(adapter_cls=Adapter, token_buckets=[16])
    msg = str(info.value)
    assert msg.startswith("token bucket 16: piece 2 (submod_4, after graphslot_ref::attention): host sync")
    assert "aten._local_scalar_dense" in msg and "While executing" not in msg


# ------------------------------------------------------------- the op itself


def test_attention_op_is_a_plain_call_outside_compile():
    rt = build_reference_model(max_num_reqs=8)
    rpi = rt.req_to_token_pool.alloc(2)
    fb = make_extend_batch(rt, rpi, [0, 0], [[1, 2, 3], [4, 5]])
    before = rt.forward(fb)
    assert install_graph_attention(rt.model) == rt.config.num_layers
    assert install_graph_attention(rt.model) == rt.config.num_layers  # idempotent
    assert all(isinstance(layer.self_attn.backend, GraphAttentionBackend) for layer in rt.model.layers)
    assert torch.equal(rt.forward(fb), before)


def test_config_dataclass():
    cfg = PrefillRunnerConfig(capture="piecewise", max_bs=4, token_buckets=[8], split_ops=(ATTENTION_OP,))
    rt = build_reference_model(max_num_reqs=16)
    runner = PrefillGraphRunner(ReferencePrefillAdapter(rt), cfg, progress=False)
    assert runner.buckets == [8] and runner.max_bs == 4
    against_eager(rt, runner, [make_extend_batch(rt, rt.req_to_token_pool.alloc(2), [0, 0], [[1, 2], [3]])])


def test_sliding_window_model():
    config = TinyConfig(sliding_window=4, swa_layers=(0,))
    rt, _, runner = make_runner(config, token_buckets=[16, 32])
    assert runner.registry.has_slot("out_cache_loc_swa")
    against_eager(rt, runner, mixed_batches(rt, seed=5, sizes=(1, 3, 4, 8), max_len=4))
