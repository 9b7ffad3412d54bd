"""The graph backend protocols are explicit: callers test isinstance, never probe.

``GraphBackend`` declares ``capture`` and ``begin_capture() -> OpenCapture``;
``InspectableGraph`` is a graph that can list its external inputs. The shipped backends
and graphs satisfy what they claim, and the generic capture helper ``no_collection``
lives in ``graphslot.graphs.util`` (no CUDA needed).
"""

from __future__ import annotations

import gc

import pytest
import torch

from graphslot.graphs import (
    CudaGraphBackend,
    EagerStep,
    Graph,
    GraphBackend,
    GraphCaptureError,
    InspectableGraph,
    OpenCapture,
    SegmentedGraph,
    TapeBackend,
    TapeGraph,
    get_graph_backend,
    no_collection,
)
from graphslot.graphs.cuda import CudaGraphWrapper
from graphslot.runners.breakable import begin_segment, capture_breakable, eager_on_graph


def test_the_shipped_backends_implement_the_backend_protocol():
    # CudaGraphBackend touches no CUDA at construction, so a CPU build can check it too.
    for backend in (TapeBackend(), get_graph_backend("cpu", "cpu"), CudaGraphBackend("cuda")):
        assert isinstance(backend, GraphBackend)


def test_a_tape_capture_is_an_open_capture_and_its_graph_is_inspectable():
    x = torch.ones(3)
    capture = TapeBackend().begin_capture()
    assert isinstance(capture, OpenCapture)
    y = x * 2
    graph = capture.end(y)
    assert isinstance(graph, TapeGraph) and isinstance(graph, Graph) and isinstance(graph, InspectableGraph)
    assert graph.external_inputs([]) == [x] and graph.external_inputs([x]) == []


def test_a_cuda_graph_is_a_graph_that_cannot_list_its_inputs():
    wrapper = CudaGraphWrapper(graph=None, output=torch.zeros(1), pool=None)
    assert isinstance(wrapper, Graph) and not isinstance(wrapper, InspectableGraph)


class CaptureOnly:
    """A backend written before begin_capture was part of the protocol."""

    name = "capture-only"

    def capture(self, fn, *, warmup=1):
        return TapeBackend().capture(fn, warmup=warmup)


def test_a_backend_without_begin_capture_cannot_capture_segments():
    assert not isinstance(CaptureOnly(), GraphBackend)
    with pytest.raises(GraphCaptureError) as err:
        begin_segment(CaptureOnly())
    assert str(err.value) == (
        "graph backend 'capture-only' cannot capture segments: it does not implement the GraphBackend "
        "protocol (name, capture(fn), begin_capture() returning an OpenCapture with end(output) and abort())")


@eager_on_graph
def double(t):
    return t * 2


def test_segments_list_external_inputs_only_when_every_segment_can():
    x, w = torch.ones(4), torch.full((4,), 3.0)
    graph = capture_breakable(TapeBackend(), lambda: double(x + 1) * w, warmup=0)
    assert isinstance(graph, SegmentedGraph) and graph.num_eager_steps == 1
    assert graph.external_inputs([x]) == [w]  # the eager step's result is the graph's own
    not_inspectable = SegmentedGraph([CudaGraphWrapper(None, None, None), graph.eager_steps[0]], None)
    assert isinstance(not_inspectable.steps[1], EagerStep)
    with pytest.raises(NotImplementedError, match="cannot list its inputs; capture with 'cpu'"):
        not_inspectable.external_inputs([])


def test_no_collection_pauses_and_freezes_then_restores():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with no_collection():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_no_collection_leaves_an_engines_own_freeze_alone():
    gc.freeze()  # an engine's start-up freeze is not ours to undo
    try:
        frozen = gc.get_freeze_count()
        with no_collection():
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_backend_name_says_what_auto_and_a_backend_object_give():
    from graphslot.graphs.backend import backend_name
    from graphslot.graphs.tape import TapeBackend

    assert [backend_name("auto", "cpu"), backend_name("auto", "cuda:0"), backend_name("cpu", "cuda:0")] == [
        "cpu", "cuda", "cpu"]
    assert backend_name(TapeBackend(), "cuda:0") == "cpu"  # an object is what it is, whatever the device
