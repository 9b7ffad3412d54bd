"""The decode runner counts the batch sizes it serves, and captures a plan made from them."""

from __future__ import annotations

from collections import Counter

from graphslot.reference import Scheduler, build_reference_model
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from graphslot.planning.histogram import BatchSizeHistogram
from graphslot.planning.planner import plan_capture_sizes


def serve(rt, runner, steps):
    """Continuous batching of up to 8 requests through ``runner(fb)`` (replay, or eager
    above its largest graph), every step checked against eager; the sizes served."""
    same, sizes = output_check(rt.device), []

    def decode_fn(fb):
        out = runner(fb)[: fb.batch_size].clone()
        eager = rt.forward(fb)
        assert same(out, eager), f"bs={fb.batch_size} differs from eager ({same.name})"
        sizes.append(fb.batch_size)
        return eager

    Scheduler(rt, seed=3, max_running=8, num_requests=20, max_new_tokens=(4, 20),
              max_arrival_gap=2).run(decode_fn, max_steps=steps)
    return sizes


def test_a_runner_built_from_a_plan_serves_it_and_counts_replayed_and_eager_steps(tmp_path):
    plan = plan_capture_sizes({1: 1, 2: 1, 3: 6, 5: 4, 6: 3}, 3)
    assert plan.sizes == (3, 5, 6)
    rt = build_reference_model(device="cpu", max_num_reqs=16)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(capture_bs=plan, max_bs=plan.max_bs,
                                                                              progress=False))
    assert runner.captured_sizes == [6, 5, 3]
    sizes = serve(rt, runner, steps=40)
    assert {7, 8} & set(sizes) and set(sizes) & {1, 2, 4}, "no step ran eager, or none padded"
    assert runner.histogram.counts == Counter(sizes)  # replayed and eager steps alike

    path = tmp_path / "served.json"
    runner.histogram.save(path)
    loaded = BatchSizeHistogram.load(path)
    assert loaded.counts == Counter(sizes) and loaded.num_tokens_per_bs == 1
    replan = plan_capture_sizes(loaded, 4)
    assert replan.max_bs == max(sizes) and not replan.eager

    again = DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(**replan.runner_kwargs(),
                                                                             progress=False))
    assert again.captured_sizes == sorted(replan.sizes, reverse=True)
    runner.histogram.clear()
    assert runner.histogram.counts == {} and runner.histogram.steps == 0


def test_a_prefill_falling_back_to_eager_is_not_a_decode_size():
    from graphslot.reference import make_extend_batch

    rt = build_reference_model(device="cpu", max_num_reqs=16)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=4, progress=False)
    rpi = rt.req_to_token_pool.alloc(2)
    runner(make_extend_batch(rt, rpi, [0, 0], [[1, 2, 3], [4, 5]]))  # 2 requests, 5 tokens: eager
    assert runner.metrics()["eager_fallbacks"] == 1 and runner.histogram.counts == {}
