"""No silent explosion (docs/dispatch.md, "The capture session", point 1): a capture that
asks for more than ``max_graphs`` graphs is refused before any graph is captured, naming
the knobs that make keys; the phase runners and the ModelGraphRunner alike."""

from __future__ import annotations

import pytest

from graphslot.reference import build_reference_model
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import DecodeGraphRunner, PrefillGraphRunner
from graphslot.runners.decode import DecodeRunnerConfig
from graphslot.runners.graph_count import GraphCountError
from graphslot.runners.model_runner import ModelGraphRunner
from graphslot.runners.prefill import PrefillRunnerConfig


class NoCaptureBackend:
    """A backend that counts and refuses every capture: a test that reaches one fails."""

    name = "cpu"

    def __init__(self):
        from graphslot.graphs import graph_pool

        self.pool = graph_pool("cpu")
        self.captures = 0

    def capture(self, fn, *, warmup=1):
        self.captures += 1
        raise AssertionError("a graph was captured")

    def begin_capture(self):
        self.captures += 1
        raise AssertionError("a graph was captured")

    def release(self):
        pass


def test_prefill_full_at_8192_tokens_and_64_requests_is_refused_at_construction_not_captured():
    rt = build_reference_model(max_num_reqs=64)
    backend = NoCaptureBackend()
    with pytest.raises(GraphCountError) as info:
        PrefillGraphRunner(ReferencePrefillAdapter(rt), capture="full", max_num_tokens=8192, max_bs=64,
                           backend=backend, progress=False)
    assert str(info.value) == (
        "prefill capture='full' (58 token buckets x 11 request slots) asks for 638 graphs, more than max_graphs=512 "
        "(none captured): fewer keys (token_buckets, request_buckets), lazy=True (only the keys steps use), "
        "or a larger max_graphs")
    assert backend.captures == 0


def test_a_decode_runner_past_its_max_graphs_is_refused_naming_its_knobs():
    rt = build_reference_model(max_num_reqs=8)
    backend = NoCaptureBackend()
    with pytest.raises(GraphCountError, match=r"^decode capture='full' \(3 batch sizes x 2 context buckets\) asks "
                                              r"for 6 graphs, more than max_graphs=5 .*capture_bs, "
                                              r"capture_bs_multiple, context_buckets"):
        DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture_bs=[1, 2, 4], context_buckets=[16, 32], max_bs=4,
                          max_graphs=5, backend=backend, progress=False)
    assert backend.captures == 0


def test_the_limit_holds_when_the_keys_are_just_enough():
    rt = build_reference_model(max_num_reqs=8)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture_bs=[1, 2], max_bs=2, max_graphs=2, progress=False)
    assert len(runner.graphs) == 2


def test_a_lazy_runner_is_refused_at_the_capture_past_the_limit():
    rt = build_reference_model(max_num_reqs=8)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture_bs=[1, 2, 4], max_bs=4, max_graphs=2, lazy=True,
                               progress=False)
    runner.graph(1)
    runner.graph(2)
    with pytest.raises(GraphCountError, match=r"asks for 3 graphs, more than max_graphs=2 \(none captured\): "
                                              r"fewer keys \(capture_bs, capture_bs_multiple, context_buckets\), "
                                              r"or a larger"):
        runner.graph(4)
    assert sorted(runner.graphs) == [1, 2]


@pytest.mark.parametrize("max_graphs", [0, -1, 2.5, True, None])
def test_max_graphs_must_be_a_positive_int(max_graphs):
    rt = build_reference_model(max_num_reqs=8)
    with pytest.raises(ValueError, match=rf"^max_graphs must be an int >= 1, got {max_graphs!r}$"):
        DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture_bs=[1], max_bs=1, max_graphs=max_graphs, progress=False)


class Variants(ReferenceDecodeAdapter):
    """Three variants, each the base model (enough to count them)."""

    variants = ("", "lora", "spec")

    def variant(self, fb):
        return ""

    def for_variant(self, variant):
        return Variants(self.runtime)  # one adapter per variant: an object bound to two is refused


def test_the_model_runner_counts_every_mode_and_variant_before_capturing_any():
    rt = build_reference_model(max_num_reqs=64)
    backend = NoCaptureBackend()
    with pytest.raises(GraphCountError) as info:
        ModelGraphRunner(Variants(rt), ReferencePrefillAdapter(rt), max_bs=64, max_num_tokens=512, backend=backend,
                         decode_config=DecodeRunnerConfig(context_buckets=[32, 64]),
                         prefill_config=PrefillRunnerConfig(token_buckets=list(range(16, 513, 16))),
                         max_graphs=97, progress=False)
    assert str(info.value) == (
        "ModelGraphRunner (full: 11 batch sizes x 2 context buckets x 3 variants ('', 'lora', 'spec') = 66; "
        "piecewise: 32 token buckets x 1 variant ('') = 32) asks for 98 graphs, more than max_graphs=97 "
        "(none captured): fewer keys (capture_bs, capture_bs_multiple, context_buckets, token_buckets, "
        "request_buckets, the adapters' variants), or a larger max_graphs")
    assert backend.captures == 0
