"""The runners' public API (issue 23): dispatch apart from capture and replay, step
observers instead of a settable hook, a public capture view, one config shape, and
package-level exports."""

from __future__ import annotations

import pytest

import graphslot.runners as runners
from graphslot.graphs import InspectableGraph, TapeBackend
from graphslot.reference import build_reference_model, make_decode_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import DecodeGraphRunner, DecodeRunnerConfig, PrefillGraphRunner, PrefillRunnerConfig
from graphslot.runners.config import GraphRunnerConfig
from graphslot.runners.dispatch import SizeDispatcher
from graphslot.spec.budget import BufferBudgetError
from graphslot.tools import capture_on_tape

# ------------------------------------------------------------------------- dispatch


def test_the_dispatcher_pads_to_the_smallest_captured_size_that_holds_the_rows():
    d = SizeDispatcher([1, 8, 2, 4, 4])
    assert d.sizes == [8, 4, 2, 1] and d.largest == 8 and 4 in d and 3 not in d
    assert [d.pad(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [d.size_problem(n) for n in (1, 5, 8)] == [None, None, None]
    assert d.size_problem(9) == "larger than the largest graph"


def test_without_padding_only_a_captured_size_runs():
    d = SizeDispatcher([8, 4], disable_padding=True)
    assert d.size_problem(4) is None and d.size_problem(8) is None
    assert d.size_problem(5) == "no graph of this exact size (padding disabled)"
    assert d.size_problem(9) == "no graph of this exact size (padding disabled)"


def test_the_dispatcher_names_a_batch_that_is_no_decode_step():
    d = SizeDispatcher([4, 2], num_tokens_per_bs=2)
    assert d.step_problem(0, None) == "empty batch"
    assert d.step_problem(3, 1) == "not 2 token(s) per request (another forward mode)"
    assert d.step_problem(3, None) == "not 2 token(s) per request (another forward mode)"
    assert d.step_problem(3, 2) is None
    assert [d.rows_for_tokens(n) for n in (0, 1, 2, 3, 8)] == [0, 1, 1, 2, 4]


@pytest.mark.parametrize("sizes", [[], [0, 4], [-1]])
def test_a_dispatcher_needs_positive_sizes(sizes):
    with pytest.raises(ValueError, match="captured sizes must be ints >= 1"):
        SizeDispatcher(sizes)


# --------------------------------------------------------------- the decode runner


def make_runner(**kwargs):
    rt = build_reference_model(max_num_reqs=16)
    kwargs.setdefault("progress", False)
    return rt, DecodeGraphRunner(ReferenceDecodeAdapter(rt), DecodeRunnerConfig(max_bs=8, **kwargs))


def decode_batch(rt, n):
    rpi = rt.req_to_token_pool.alloc(n)
    seq_lens = [3] * n
    for r in rpi:
        rt.req_to_token_pool.write(r, 0, rt.token_to_kv_pool.alloc(3))
    return make_decode_batch(rt, rpi, seq_lens, [1] * n)


def test_the_runner_dispatches_through_its_dispatcher():
    rt, runner = make_runner(capture_bs=[8, 4, 2])
    assert isinstance(runner.dispatch, SizeDispatcher)
    assert runner.captured_sizes is runner.dispatch.sizes and runner.captured_sizes == [8, 4, 2]
    fb = decode_batch(rt, 3)
    assert runner.padded_bs(fb) == runner.dispatch.pad(3) == 4


class Recorder:
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def after_fill(self, raw_bs, padded_bs):
        self.seen.append((self.name, raw_bs, padded_bs))


def test_observers_see_every_replayed_step_after_its_fill_in_order():
    rt, runner = make_runner()
    seen = []
    first, second = Recorder("first", seen), Recorder("second", seen)
    runner.add_observer(first)
    runner.add_observer(second)
    fb = decode_batch(rt, 3)
    runner(fb)
    assert seen == [("first", 3, 4), ("second", 3, 4)]
    runner.remove_observer(first)
    runner.replay(fb, count=False)
    assert seen[2:] == [("second", 3, 4)]
    runner.remove_observer(second)
    runner(fb)
    assert len(seen) == 3
    with pytest.raises(ValueError):
        runner.remove_observer(second)


def test_an_observer_sees_the_filled_buffers_and_eager_steps_are_not_observed():
    rt, runner = make_runner()
    rows = []

    class ReadsTheBuffer:
        def after_fill(self, raw_bs, padded_bs):
            rows.append(runner.registry.slot("input_ids").buffer[:raw_bs].tolist())

    runner.add_observer(ReadsTheBuffer())
    fb = decode_batch(rt, 3)
    runner(fb)
    assert rows == [fb.input_ids.tolist()]
    runner(decode_batch(rt, 9))  # larger than the largest graph: eager, no fill
    assert len(rows) == 1 and runner.metrics()["eager_reasons"] == {"larger than the largest graph": 1}


def test_an_observer_that_raises_aborts_the_step_before_its_replay():
    rt, runner = make_runner()

    class Fails:
        def after_fill(self, raw_bs, padded_bs):
            raise RuntimeError("observer failed")

    runner.add_observer(Fails())
    with pytest.raises(RuntimeError, match="observer failed"):
        runner(decode_batch(rt, 3))
    assert runner.metrics()["replays"] == 0


def test_the_public_capture_view_recaptures_a_size_on_any_backend():
    rt, runner = make_runner()
    view = runner.capture_view(4)
    assert view.batch_size == 4 and view.input_ids.data_ptr() == runner.registry.slot("input_ids").buffer.data_ptr()
    out = runner.graph_body(view, 4)
    assert out.shape[0] == 4
    graph, view = runner.capture_on(TapeBackend(), 4)
    assert isinstance(graph, InspectableGraph) and graph.output.shape == out.shape
    assert graph.external_inputs(runner.declared_statics()) == []
    tape_graph, _ = capture_on_tape(runner, 2)  # the audit's recapture, through the same API
    assert isinstance(tape_graph, InspectableGraph) and tape_graph.output.shape[0] == 2


# ------------------------------------------------------------------------- configs


def test_decode_and_prefill_configs_share_one_base():
    shared = {"max_bs", "capture", "split_ops", "compile_backend", "backend", "graph_pool", "capture_context", "impl",
              "params", "progress", "warmup", "warmup_sizes", "lazy", "max_bytes", "buffers", "max_graphs", "guard"}
    base = set(GraphRunnerConfig.__dataclass_fields__)
    assert base == shared
    assert issubclass(DecodeRunnerConfig, GraphRunnerConfig) and issubclass(PrefillRunnerConfig, GraphRunnerConfig)
    assert DecodeRunnerConfig().max_bs == 32 and PrefillRunnerConfig().max_bs == 8


def test_an_unknown_override_names_itself():
    rt = build_reference_model(max_num_reqs=4)
    with pytest.raises(TypeError, match="max_batch"):
        DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_batch=4)


def test_a_prefill_runner_takes_the_byte_cap_from_its_config():
    rt = build_reference_model(max_num_reqs=4)
    with pytest.raises(BufferBudgetError, match="max_bytes"):
        PrefillGraphRunner(ReferencePrefillAdapter(rt), PrefillRunnerConfig(max_bytes=64, progress=False))


def test_the_runners_package_exports_its_public_api():
    for name in runners.__all__:
        assert getattr(runners, name) is not None, name
    assert runners.DecodeGraphRunner.__module__ == "graphslot.runners.decode"
    assert set(runners.__all__) == {  # what an engine needs (docs/api.md); the rest stays in its module
        "DecodeGraphRunner", "DecodeRunnerConfig", "DecodeAdapter", "PrefillAdapter", "PrefillGraphRunner",
        "PrefillRunnerConfig", "eager_on_graph", "EagerRunner", "DPDecodeRunner", "DPExchange", "DPStepError",
        "AdapterContractError", "ReplayGuardError", "ModelGraphRunner", "GraphKey", "BatchDescriptor", "Dispatcher",
        "Dispatch", "GraphCountError"}
