"""The replay guard names a tensor that moved since capture, and is re-armed whenever the
runner captures afresh (a weight reload then recapture(): issue 44, item 9); runner
metrics count replays per size, padded rows and eager fallbacks by reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.runners.adapter import DecodeAdapter
from graphslot.runners.decode import DecodeGraphRunner
from graphslot.runners.guard import GUARD_ENV, ReplayGuardError


def setup(**config):
    rt = build_reference_model(max_num_reqs=8)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=4, progress=False, **config)
    rpi = rt.req_to_token_pool.alloc(6)
    rt.forward(make_extend_batch(rt, rpi, [0] * 6, [[i + 1, i + 2] for i in range(6)]))
    return rt, runner, lambda n: make_decode_batch(rt, rpi[:n], [2] * n, [3] * n)


def test_a_reallocated_static_tensor_is_named_before_replay():
    rt, runner, batch = setup(guard=True)
    runner.replay(batch(3))  # nothing moved yet
    pool = rt.req_to_token_pool
    pool.req_to_token = pool.req_to_token.clone()  # same values, new memory: the graph reads the old one
    with pytest.raises(ReplayGuardError, match=r"^replay guard: static tensor 'req_to_token_pool.req_to_token' "
                                               r"moved since capture: was \[9, 64\] int64 at 0x[0-9a-f]+, now "
                                               r"\[9, 64\] int64 at 0x[0-9a-f]+; the captured graph still reads "
                                               r"the old memory"):
        runner.replay(batch(3))


def test_a_rebound_slot_buffer_or_weight_is_named():
    rt, runner, batch = setup(guard=True)
    seq_lens = runner.registry.slot("seq_lens")
    original, seq_lens.buffer = seq_lens.buffer, seq_lens.buffer.clone()
    with pytest.raises(ReplayGuardError, match="slot 'seq_lens' moved since capture"):
        runner.replay(batch(2))
    seq_lens.buffer = original
    runner.replay(batch(2))
    k0 = rt.token_to_kv_pool.k_buffer[0]
    k0.resize_(k0.shape[0] - 1, *k0.shape[1:])  # same memory, another shape
    with pytest.raises(ReplayGuardError, match=r"static tensor 'token_to_kv_pool.k_buffer\[0\]' changed shape or "
                                               r"dtype since capture: was \[(\d+), 2, 16\] float32 at (0x[0-9a-f]+), "
                                               r"now \[\d+, 2, 16\] float32 at \2"):
        runner.replay(batch(2))


def test_a_weight_replaced_through_data_is_named():
    rt, runner, batch = setup(guard=True)
    weight = rt.model.embed_tokens.weight
    weight.data = weight.data.to(torch.float64)
    with pytest.raises(ReplayGuardError, match=r"static tensor 'model.embed_tokens.weight' moved since capture: "
                                               r"was \[128, 64\] float32 at .*, now \[128, 64\] float64"):
        runner.replay(batch(2))


def reload_a_weight(rt):
    """A new Parameter for one layer weight: what a weight reload does (the graphs read the old one)."""
    proj = rt.model.layers[0].mlp.down_proj
    proj.weight = nn.Parameter(proj.weight * 1.5, requires_grad=False)


def same_as_eager(rt, runner, fb):
    return output_check(rt.device)(runner(fb).clone(), rt.forward(fb))


def test_a_weight_reload_then_recapture_replays_the_new_weights_with_the_guard_on():
    rt, runner, batch = setup(guard=True)
    assert same_as_eager(rt, runner, batch(3))
    reload_a_weight(rt)
    with pytest.raises(ReplayGuardError, match="static tensor 'model.layers.0.mlp.down_proj.weight' moved"):
        runner(batch(3))  # the graphs read the old weight: the guard says so
    runner.recapture()
    assert [same_as_eager(rt, runner, batch(n)) for n in (1, 2, 3, 4)] == [True] * 4
    assert runner.metrics()["replays"] == 5


def test_lazy_captures_with_the_guard_on():
    rt, runner, batch = setup(guard=True, lazy=True)
    assert same_as_eager(rt, runner, batch(1)) and same_as_eager(rt, runner, batch(3))  # each a new key
    assert sorted(runner.graphs) == [1, 4]
    reload_a_weight(rt)
    runner.release()  # lazy: the next steps capture again, reading the new weight
    assert same_as_eager(rt, runner, batch(2)) and same_as_eager(rt, runner, batch(1))
    reload_a_weight(rt)
    runner.recapture()  # the keys captured so far (2 and 1), with the weight reloaded again
    assert sorted(runner.graphs) == [1, 2]
    assert same_as_eager(rt, runner, batch(3)) and same_as_eager(rt, runner, batch(2))  # 4: a new key, lazily
    assert runner.metrics()["replays"] == 6


def test_a_lazy_capture_beside_stale_graphs_does_not_hide_them():
    rt, runner, batch = setup(guard=True, lazy=True)
    runner(batch(1))
    rt.req_to_token_pool.req_to_token = rt.req_to_token_pool.req_to_token.clone()  # the graph of 1 reads the old
    with pytest.raises(ReplayGuardError, match="static tensor 'req_to_token_pool.req_to_token' moved since capture"):
        runner(batch(3))  # a new key's capture keeps the snapshot the graph of 1 was captured with


def test_the_guard_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(GUARD_ENV, raising=False)
    rt, runner, batch = setup()
    assert runner.guard is None
    rt.req_to_token_pool.req_to_token = rt.req_to_token_pool.req_to_token.clone()
    runner.replay(batch(1))  # silently reads the old pool: what the guard is for
    monkeypatch.setenv(GUARD_ENV, "1")
    assert setup()[1].guard is not None
    assert setup(guard=False)[1].guard is None  # the config wins over the environment


def test_unnamed_statics_are_named_by_position():
    class Plain(DecodeAdapter):
        def static_tensors(self):
            return [torch.zeros(2), torch.ones(3)]

    names = [name for name, _ in Plain().named_static_tensors()]
    assert names == ["#0 of Plain.static_tensors()", "#1 of Plain.static_tensors()"]


def test_metrics_count_replays_padding_and_eager_fallbacks():
    rt, runner, batch = setup()
    for n in (3, 4, 1, 3):
        runner(batch(n))
    runner(batch(6))  # more requests than the largest graph
    runner(make_extend_batch(rt, [7], [0], [[5, 6, 7]]))  # a prefill
    m = runner.metrics()
    assert m["replays"] == 4 and m["replays_per_size"] == {"1": 1, "4": 3}
    assert m["raw_rows"] == 11 and m["padded_rows"] == 2 and m["padding_fraction"] == pytest.approx(2 / 13)
    assert m["eager_fallbacks"] == 2
    assert m["eager_reasons"] == {"larger than the largest graph": 1,
                                  "not 1 token(s) per request (another forward mode)": 1}
    runner.stats.reset()
    assert runner.metrics()["replays"] == 0


def test_a_weight_restrided_in_place_is_named():
    """``w.data = w.data.t()`` on a square weight keeps its address, shape and dtype: only the strides say the
    graph reads it in the old layout (eager would read the new one: a silent difference without the guard)."""
    rt, runner, batch = setup(guard=True)
    runner.replay(batch(2))
    weight = rt.model.layers[0].self_attn.o_proj.weight
    weight.data = weight.data.t()
    with pytest.raises(ReplayGuardError, match=r"static tensor 'model.layers.0.self_attn.o_proj.weight' changed "
                                               r"layout since capture: was \[64, 64\] float32 strides \[64, 1\] "
                                               r"at 0x[0-9a-f]+, now \[64, 64\] float32 strides \[1, 64\]"):
        runner.replay(batch(2))
