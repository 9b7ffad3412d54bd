"""The decode graph runner replays exactly what eager computes, whatever the batch."""

from __future__ import annotations

import re

import pytest
import torch
from graph_counting import replays_one_step

from graphslot.reference import Scheduler, TinyConfig, build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.runners.decode import DecodeGraphRunner, DecodeRunnerConfig
from graphslot.runners.dispatch import capture_sizes

SWA_CONFIG = TinyConfig(sliding_window=4, swa_layers=(0,))
DP_PARAMS = {"require_gathered_buffer": True, "require_mlp_tp_gather": True, "dp_size": 2}


def make_runner(config=None, max_num_reqs=16, device="cpu", **runner_kwargs):
    rt = build_reference_model(config, device=device, max_num_reqs=max_num_reqs)
    adapter = ReferenceDecodeAdapter(rt)
    runner_kwargs.setdefault("progress", False)
    return rt, adapter, DecodeGraphRunner(adapter, DecodeRunnerConfig(**runner_kwargs))


def decode_against_eager(rt, runner, steps=60, **sched_kwargs):
    """Drive the scheduler with graph-then-eager decodes; the batch sizes seen. Bit-exact
    on the CPU tape where the matmul is batch-invariant (reference/numerics.py). Every
    step must replay a captured graph (counted by the backend)."""
    same = output_check(rt.device)
    sizes = []

    def decode_fn(fb):
        assert runner.can_run(fb)
        with replays_one_step(runner):
            graph = runner.replay(fb).clone()
        eager = rt.forward(fb)
        assert same(graph, eager), f"step with bs={fb.batch_size} differs from eager ({same.name})"
        sizes.append(fb.batch_size)
        return eager

    sched_kwargs.setdefault("num_requests", 24)
    sched_kwargs.setdefault("max_new_tokens", (1, 24))
    Scheduler(rt, seed=1, max_running=runner.captured_sizes[0], **sched_kwargs).run(decode_fn, max_steps=steps)
    return sizes


def prefill(rt, prompts):
    rpi = rt.req_to_token_pool.alloc(len(prompts))
    rt.forward(make_extend_batch(rt, rpi, [0] * len(prompts), prompts))
    return rpi


# ------------------------------------------------------------------- graph == eager


@pytest.mark.parametrize("mode", ["generated", "interpreted"])
def test_decode_equals_eager_across_batch_sizes_and_padding(mode):
    rt, _, runner = make_runner(max_bs=8, impl=mode)
    assert runner.captured_sizes == [8, 4, 2, 1] and runner.registry.impl == mode
    sizes = decode_against_eager(rt, runner)
    assert len(set(sizes)) >= 5
    assert set(sizes) - set(runner.captured_sizes), "no step needed padding"


def test_padding_to_a_larger_graph_for_a_single_request_is_exact():
    rt, _, runner = make_runner(max_bs=8, capture_bs_multiple=4)
    assert runner.captured_sizes == [8, 4]
    assert 1 in decode_against_eager(rt, runner, steps=40)


def test_speculative_verify_with_two_tokens_per_request():
    rt, _, runner = make_runner(max_bs=8, num_tokens_per_bs=2)
    assert runner.registry.max_num_tokens == 16
    prompts = [[(7 * i + j) % 100 + 1 for j in range(3 + i % 4)] for i in range(8)]
    rpi = prefill(rt, prompts)
    lens = [len(p) for p in prompts]
    for step, bs in enumerate([3, 1, 8, 5, 2, 7, 4, 6]):
        drafts = [[(step + i) % 90 + 1, (step * i) % 90 + 2] for i in range(bs)]
        fb = make_decode_batch(rt, rpi[:bs], lens[:bs], drafts)
        assert runner.can_run(fb)
        with replays_one_step(runner):
            graph = runner.replay(fb)
        assert graph.shape[0] == bs * 2
        graph = graph.clone()
        assert torch.equal(graph, rt.forward(fb))
        lens[:bs] = [n + 2 for n in lens[:bs]]
    decode = make_decode_batch(rt, rpi[:2], lens[:2], [1, 2])
    assert not runner.can_run(decode)  # k=1 batch, k=2 graphs


def test_hybrid_swa_registers_its_slot_before_capture():
    rt, _, runner = make_runner(SWA_CONFIG, max_bs=8)
    reg = runner.registry
    assert reg.params["is_hybrid_swa"] and reg.has_slot("out_cache_loc_swa")
    assert rt.token_to_kv_pool._out_cache_loc_swa is reg.slot("out_cache_loc_swa").buffer
    sizes = decode_against_eager(rt, runner, steps=50)
    assert max(sizes) > 4


def test_dp_gathered_buffers():
    rt, adapter, runner = make_runner(max_bs=8, params=DP_PARAMS)
    sizes = runner.captured_sizes
    captured = adapter.dp_buffer_lens[: len(sizes)]
    assert captured == [([bs, bs], 2 * bs) for bs in sizes]

    rpi = prefill(rt, [[1, 2, 3], [4, 5]])
    fb = make_decode_batch(rt, rpi, [3, 2], [6, 7])
    fb.global_num_tokens_cpu = [2, 5]  # the other rank is busier: every rank runs 8
    assert runner.padded_bs(fb) == 8
    with replays_one_step(runner):
        graph = runner.replay(fb).clone()
    for name in ("global_num_tokens_gpu", "global_num_tokens_for_logprob_gpu"):
        assert runner.registry.slot(name).buffer.tolist() == [8, 8]
    assert adapter.dp_buffer_lens[-1] == ([8, 8], 16)
    assert torch.equal(graph, rt.forward(fb))
    fb.global_num_tokens_cpu = [2, 9]
    assert not runner.can_run(fb)


# -------------------------------------------------------------------------- sizes


def test_capture_schedule():
    assert capture_sizes(40) == [40, 32, 24, 16, 8, 4, 2, 1]
    assert capture_sizes(12) == [12, 8, 4, 2, 1]  # the cap itself is captured
    assert capture_sizes(40, multiple=4) == [40, 32, 24, 16, 8, 4]
    assert capture_sizes(40, max_requests=20) == [20, 16, 8, 4, 2, 1]
    assert capture_sizes(16, explicit=[3, 1, 7, 3]) == [7, 3, 1]  # duplicates merged, largest first
    assert capture_sizes(16, explicit=[3, 1, 7, 12], max_requests=8) == [7, 3, 1]  # beyond the request pool
    with pytest.raises(ValueError, match="no batch size"):
        capture_sizes(3, multiple=4)


def test_runner_captures_largest_first_within_the_request_pool():
    order = []

    class Recording(ReferenceDecodeAdapter):
        def init_capture_metadata(self, bs, num_tokens, view):
            order.append(bs)
            super().init_capture_metadata(bs, num_tokens, view)

    rt = build_reference_model(max_num_reqs=6)
    runner = DecodeGraphRunner(Recording(rt), max_bs=16, progress=False)
    assert runner.captured_sizes == order == [6, 4, 2, 1]
    assert runner.registry.max_bs == 6 and runner.static_bytes == runner.registry.nbytes > 0
    assert runner.capture_seconds > 0


def test_can_run():
    rt, _, runner = make_runner(max_bs=4)
    rpi = prefill(rt, [[i + 1, i + 2] for i in range(6)])
    assert runner.can_run(make_decode_batch(rt, rpi[:3], [2] * 3, [1] * 3))
    too_big = make_decode_batch(rt, rpi, [2] * 6, [1] * 6)
    assert not runner.can_run(too_big)
    assert torch.equal(runner(too_big), rt.forward(too_big))  # __call__ falls back to eager
    extend = make_extend_batch(rt, rpi[:1], [3], [[5, 6]])
    assert not runner.can_run(extend)

    _, _, exact = make_runner(max_bs=4, disable_padding=True)
    fb = make_decode_batch(rt, rpi[:3], [5] * 3, [1] * 3)
    assert not exact.can_run(fb) and exact.can_run(make_decode_batch(rt, rpi[:4], [6] * 4, [1] * 4))


# ----------------------------------------------------------------- external inputs


def test_reference_model_reads_no_external_inputs():
    _, _, runner = make_runner(SWA_CONFIG, max_bs=4)
    for bs in runner.captured_sizes:
        assert runner.external_inputs(bs) == []


def test_a_batch_tensor_outside_the_slots_is_reported():
    class ReadsExtra(ReferenceDecodeAdapter):
        def make_dummy_batch(self, bs, num_tokens):
            fb = super().make_dummy_batch(bs, num_tokens)
            fb.logit_bias = torch.zeros(self.runtime.config.vocab_size)
            self.bias = fb.logit_bias
            return fb

        def forward(self, fb):
            return super().forward(fb) + fb.logit_bias  # not a slot: baked in at capture

    rt = build_reference_model()
    runner = DecodeGraphRunner(ReadsExtra(rt), max_bs=2, progress=False)
    found = runner.external_inputs(1)
    assert len(found) == 1
    assert found[0].untyped_storage().data_ptr() == runner.adapter.bias.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [None, SWA_CONFIG], ids=["full", "swa"])
def test_cuda_graphs_match_eager(config):
    rt, _, runner = make_runner(config, device="cuda", max_bs=8)
    assert runner.backend.name == "cuda"
    assert len(set(decode_against_eager(rt, runner))) >= 5


def test_a_lazy_runner_captures_each_size_when_first_needed_and_replays_it_exactly():
    rt, adapter, runner = make_runner(max_bs=8, lazy=True)
    assert runner.graphs == {} and runner.capture_seconds == 0.0 and runner.captured_sizes == [8, 4, 2, 1]
    same = output_check(rt.device)
    rpi = rt.req_to_token_pool.alloc(7)
    for bs, captured in ((3, [4]), (2, [2, 4]), (4, [2, 4]), (7, [2, 4, 8])):
        # A fresh size is captured before the fill: the capture's dummy batch must not
        # overwrite this step's inputs.
        fb = make_decode_batch(rt, rpi[:bs], [5 + i for i in range(bs)], [11 * i + 1 for i in range(bs)])
        with replays_one_step(runner):
            out = runner(fb).clone()
        assert same(out, rt.forward(fb)), f"bs {bs}"
        assert sorted(runner.graphs) == captured
    assert runner.capture_seconds > 0
    assert runner.metrics()["replays_per_size"] == {"2": 1, "4": 2, "8": 1}
    with pytest.raises(KeyError, match="batch size 3 is not among the captured sizes"):
        runner.graph(3)


def test_a_lazy_runner_decodes_a_whole_schedule_like_an_eager_capturing_one():
    rt, _, runner = make_runner(max_bs=8, lazy=True, capture_bs=[8, 6, 3, 1])
    sizes = decode_against_eager(rt, runner, steps=40)
    # exactly the sizes the schedule needed, each captured once
    assert set(runner.graphs) == {min(c for c in (1, 3, 6, 8) if c >= bs) for bs in sizes}
    assert len(set(runner.graphs)) >= 3


# ------------------------------------------------------------------- shared outputs


@pytest.mark.parametrize("lazy", [False, True], ids=["eager-capture", "lazy"])
def test_shared_outputs_keep_one_largest_output_and_replay_exactly(lazy):
    rt, _, runner = make_runner(max_bs=8, share_outputs=True, lazy=lazy)
    assert len(set(decode_against_eager(rt, runner))) >= 4
    (logits,) = runner.shared_outputs.tensors()
    vocab = rt.config.vocab_size
    assert logits.shape == (8, vocab)
    # every graph's output is a view of the one buffer, whatever order the sizes came in
    for bs, graph in runner.graphs.items():
        assert graph.output.shape == (bs, vocab)
        assert graph.output.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert any(t is logits for t in runner.declared_statics())  # the audit knows the graphs write it
    assert runner.external_inputs(min(runner.graphs)) == []


def test_shared_outputs_with_two_tokens_per_request_size_token_rows():
    rt, _, runner = make_runner(max_bs=4, num_tokens_per_bs=2, share_outputs=True)
    assert runner.shared_outputs.tensors()[0].shape[0] == 8  # 4 requests x 2 tokens


@pytest.mark.parametrize("output, message", [
    (lambda fb: fb.input_ids.sum(), "output tensor 0 of shape [] has neither"),
    (lambda fb: (fb.input_ids[:, None].float(), torch.ones(3)), "output tensor 1 of shape [3] has neither"),
])
def test_shared_outputs_refuse_an_output_without_rows(output, message):
    rt = build_reference_model(max_num_reqs=8)

    class Adapter(ReferenceDecodeAdapter):
        def forward(self, fb):
            return output(fb)

        def slice_output(self, out, raw_bs, raw_num_tokens, padded_bs=None, padded_num_tokens=None):
            return out

    with pytest.raises(TypeError, match=re.escape(message) + ".*or leave share_outputs off"):
        DecodeGraphRunner(Adapter(rt), max_bs=4, share_outputs=True, progress=False)


def test_shared_outputs_refuse_a_size_whose_output_does_not_fit():
    rt = build_reference_model(max_num_reqs=8)

    class Adapter(ReferenceDecodeAdapter):
        def forward(self, fb):  # a column more at every size below the largest
            logits = super().forward(fb)
            return logits if fb.batch_size == 4 else torch.cat([logits, logits[:, :1]], 1)

    with pytest.raises(TypeError,
                       match=re.escape(f"output tensor 0 of batch size 2 is [2, {rt.config.vocab_size + 1}]")):
        DecodeGraphRunner(Adapter(rt), max_bs=4, share_outputs=True, progress=False)
