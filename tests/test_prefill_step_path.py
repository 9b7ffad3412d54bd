"""The prefill runner has decode's step path (issue 43): metrics and a histogram in
tokens, the replay guard, observers after the fill, stage() then launch()."""

from __future__ import annotations

from collections import Counter

import pytest
from graph_counting import replays_one_step
from prefill_cases import make_prefill_runner

from graphslot.reference import make_decode_batch, make_extend_batch
from graphslot.runners.guard import ReplayGuardError
from graphslot.runners.prefill import TOO_MANY_TOKENS


def extend(rt, lens, prefix=0):
    """A prefill of ``len(lens)`` new requests, ``lens[i]`` tokens each."""
    rpi = rt.req_to_token_pool.alloc(len(lens))
    return make_extend_batch(rt, rpi, [prefix] * len(lens), [[7 + i] * n for i, n in enumerate(lens)])


def test_prefill_metrics_and_histogram_count_tokens_replayed_and_eager():
    rt, _, runner = make_prefill_runner(capture="breakable")  # buckets 16, 32, 64
    for lens in ([3, 4], [10, 6], [20], [30, 40]):  # 7 -> 16, 16 -> 16, 20 -> 32, 70: beyond 64
        runner(extend(rt, lens))
    rpi = rt.req_to_token_pool.alloc(1)
    rt.forward(make_extend_batch(rt, rpi, [0], [[1, 2]]))
    runner(make_decode_batch(rt, rpi, [2], [3]))  # not a prefill: no size to plan for
    m = runner.metrics()
    assert m["replays"] == 3 and m["replays_per_size"] == {"16": 2, "32": 1}
    assert m["raw_rows"] == 43 and m["padded_rows"] == 9 + 0 + 12
    assert m["eager_reasons"] == {TOO_MANY_TOKENS: 1, "not a prefill": 1}
    assert runner.histogram.counts == Counter({7: 1, 16: 1, 20: 1, 70: 1})
    assert runner.backend.replays > 0


def test_verify_style_replays_stay_out_of_the_metrics():
    rt, _, runner = make_prefill_runner(capture="full", request_buckets=[4, 8])
    with replays_one_step(runner):
        runner.replay(extend(rt, [3, 3]), count=False)
    assert runner.metrics()["replays"] == 0 and runner.histogram.counts == {}


def test_prefill_observers_see_the_fill_with_its_token_counts():
    rt, _, runner = make_prefill_runner(capture="full", request_buckets=[4, 8])
    seen = []

    class Recorder:
        def after_fill(self, raw_bs, padded_bs):
            seen.append((raw_bs, padded_bs, runner.last_fill.raw_tokens, runner.last_fill.padded_tokens,
                         runner.registry.slot("input_ids").buffer[:5].tolist()))

    observer = Recorder()
    runner.add_observer(observer)
    fb = extend(rt, [2, 3])
    runner(fb)
    assert seen == [(2, 4, 5, 16, fb.input_ids.tolist())]  # 2 requests in 4 request slots, 5 tokens in 16
    runner.remove_observer(observer)
    runner(extend(rt, [1]))
    assert len(seen) == 1


def test_the_prefill_guard_names_a_moved_tensor_before_replay():
    rt, _, runner = make_prefill_runner(capture="breakable", guard=True)
    runner(extend(rt, [3]))
    pool = rt.req_to_token_pool
    pool.req_to_token = pool.req_to_token.clone()
    rows = list(pool.req_to_token.shape)
    with pytest.raises(ReplayGuardError, match=rf"static tensor '.+' moved since capture: was \{rows} int64"):
        runner(extend(rt, [3]))
    assert runner.steps_in_progress == 0


def test_a_prefill_step_staged_before_a_recapture_is_refused():
    rt, _, runner = make_prefill_runner(capture="breakable")
    staged = runner.stage(extend(rt, [4]))
    runner.recapture()
    with pytest.raises(RuntimeError, match="prepared before a release"):
        runner.launch(staged)


def test_a_prefill_step_whose_buffers_another_stage_filled_is_refused():
    rt, _, runner = make_prefill_runner(capture="breakable")
    first = runner.stage(extend(rt, [5, 6]))
    second = runner.stage(extend(rt, [7, 2]))  # the buffers now hold this batch, not the first
    with pytest.raises(RuntimeError, match="buffers were filled again since it was prepared"):
        runner.launch(first)
    with replays_one_step(runner):
        runner.launch(second)
