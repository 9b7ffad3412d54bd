"""The capture session (graphslot.runners.session): one entry of the engine's capture
context, one collection and one emptying of the cache per capture run, both patched to
no-ops while it lasts (restored after, errors included), its stream used, its memory
estimate and real growth logged."""

from __future__ import annotations

import contextlib
import gc
import logging
import re

import pytest
import torch

from graphslot.graphs import TapeBackend
from graphslot.graphs.backend import GraphCaptureError
from graphslot.log import get_logger
from graphslot.reference import build_reference_model
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import DecodeGraphRunner, PrefillGraphRunner
from graphslot.runners.session import CaptureSession, current_session, stream_of

SIZES = [8, 4, 2, 1]


class Counters:
    """``gc.collect`` and ``torch.cuda.empty_cache`` replaced by counters for the test."""

    def __init__(self, monkeypatch):
        self.collects = self.empties = 0
        monkeypatch.setattr(gc, "collect", self.collect)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def collect(self, *args):
        self.collects += 1
        return 0

    def empty_cache(self):
        self.empties += 1


class TorchGraphLikeBackend(TapeBackend):
    """The tape, doing at each capture what ``torch.cuda.graph`` does on entry: collect
    and empty the cache; it notes what that reached, and can fail on the n-th capture."""

    def __init__(self, counters, fail_at=None):
        super().__init__()
        self.counters = counters
        self.fail_at = fail_at
        self.captures = 0
        self.reached = []

    def begin_capture(self, stream=None):
        self.captures += 1
        before = (self.counters.collects, self.counters.empties)
        gc.collect()
        torch.cuda.empty_cache()
        self.reached.append((self.counters.collects, self.counters.empties) != before)
        if self.captures == self.fail_at:
            raise GraphCaptureError("the capture failed")
        return super().begin_capture(stream)


@pytest.mark.parametrize("capture", ["full", "piecewise"])
def test_one_collection_per_session_and_none_from_the_captures(monkeypatch, capture):
    counters = Counters(monkeypatch)
    backend = TorchGraphLikeBackend(counters)
    rt = build_reference_model(max_num_reqs=16)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture=capture, max_bs=8, capture_bs=SIZES,
                               backend=backend, progress=False)
    pieces = 1 if capture == "full" else rt.config.num_layers + 1
    assert backend.captures == len(SIZES) * pieces
    assert counters.collects == 1 and not any(backend.reached)  # the session's one; the captures' were no-ops
    assert counters.empties == 0  # a CPU device: no cache to empty
    assert gc.collect == counters.collect and torch.cuda.empty_cache == counters.empty_cache  # restored
    runner.recapture()
    assert counters.collects == 2 and not any(backend.reached)


def test_the_patches_are_restored_when_a_capture_fails(monkeypatch):
    counters = Counters(monkeypatch)
    backend = TorchGraphLikeBackend(counters, fail_at=3)
    entries = []

    @contextlib.contextmanager
    def context():
        entries.append("in")
        try:
            yield None
        except GraphCaptureError:
            entries.append("saw the error")  # the engine's context sees the capture's error, as a `with` would
            raise
        finally:
            entries.append("out")

    rt = build_reference_model(max_num_reqs=16)
    with pytest.raises(GraphCaptureError, match="the capture failed"):
        DecodeGraphRunner(ReferenceDecodeAdapter(rt), max_bs=8, capture_bs=SIZES, backend=backend, progress=False,
                          capture_context=context)
    assert gc.collect == counters.collect and torch.cuda.empty_cache == counters.empty_cache
    assert entries == ["in", "saw the error", "out"] and current_session() is None and gc.isenabled()


def test_sessions_opened_inside_a_session_join_it():
    rt = build_reference_model(max_num_reqs=64)
    entries = []

    @contextlib.contextmanager
    def context():
        entries.append(1)
        yield None

    prefill = PrefillGraphRunner(ReferencePrefillAdapter(rt), capture="piecewise", token_buckets=[16, 32],
                                 capture_context=context, progress=False)
    decode = DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture="piecewise", max_bs=4, capture_bs=[2, 4],
                               capture_context=context, progress=False)
    assert len(entries) == 2
    log = get_logger("graphslot.test")
    with CaptureSession(context=context, backend=decode.backend, device=rt.device, log=log, what="model",
                        keys="both phases", graphs=0, static_bytes=0) as outer:
        prefill.recapture()
        decode.recapture()
        assert current_session() is outer
    assert len(entries) == 3 and current_session() is None  # one entry for both phases


def test_the_stream_a_context_yields():
    class Yielded:
        stream = "the capture stream"

    assert stream_of(Yielded()) == "the capture stream"
    assert stream_of(None) is None and stream_of(object()) is None
    if torch.cuda.is_available():
        stream = torch.cuda.Stream()
        assert stream_of(stream) is stream


@pytest.fixture
def records():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("graphslot")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_count_the_estimate_and_the_growth_are_logged(records):
    rt = build_reference_model(max_num_reqs=64)
    runner = PrefillGraphRunner(ReferencePrefillAdapter(rt), capture="piecewise", token_buckets=[16, 32, 64],
                                progress=False)
    start, estimate, end = records
    assert re.fullmatch(r"capturing 3 piecewise prefill graphs \(token buckets 64, 32, 16\), backend cpu; "
                        r"static buffers \d+\.\d KiB", start)
    first = re.fullmatch(r"piecewise prefill graphs need about (\S+ \S+) \(static buffers \S+ \S+ \+ (\S+ \S+) for "
                         r"the first graph x 3\)", estimate)
    assert first, estimate
    grown = re.fullmatch(r"captured 3 piecewise prefill graphs \(token buckets 64, 32, 16\), backend cpu, in "
                         r"\d+\.\d\d s; static buffers \d+\.\d KiB; graph pool \+(\S+ \S+)", end)
    assert grown, end
    # The tape's pool holds what the graphs hold; the largest key first, so the estimate is an upper bound.
    held = runner.backend.pool.nbytes
    assert 0 < held <= approx_bytes(first[1]) and abs(held - approx_bytes(grown[1])) < 0.05 * held
    assert approx_bytes(first[2]) < runner.backend.pool.nbytes


def approx_bytes(text):
    """``"1.5 MiB"`` -> bytes, rounded as human_bytes rounds (to the tenth shown)."""
    number, unit = text.split()
    return float(number) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("capture", ["full", "piecewise"])
def test_cuda_graphs_are_captured_on_the_stream_the_context_yields(monkeypatch, capture):
    from graphslot.graphs import CudaGraphBackend

    class Watched(CudaGraphBackend):
        def __init__(self):
            super().__init__("cuda")
            self.streams = []

        def capture_stream(self, stream=None):
            chosen = super().capture_stream(stream)
            self.streams.append(chosen)
            return chosen

    class Yielded:  # what sglang's graph_capture() yields
        stream = torch.cuda.Stream()

    entries = []

    @contextlib.contextmanager
    def context():
        entries.append(1)
        yield Yielded()

    counters = Counters(monkeypatch)
    backend = Watched()
    rt = build_reference_model(device="cuda", max_num_reqs=16)
    runner = DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture=capture, max_bs=8, capture_bs=SIZES,
                               backend=backend, progress=False, capture_context=context)
    assert len(runner.graphs) == len(SIZES) and entries == [1]
    assert backend.streams and all(s is Yielded.stream for s in backend.streams)
    assert (counters.collects, counters.empties) == (1, 1)  # torch.cuda.graph's, per graph, were no-ops
    assert torch.cuda.empty_cache == counters.empty_cache
    from graphslot.reference import make_decode_batch, make_extend_batch

    rpi = rt.req_to_token_pool.alloc(3)
    rt.forward(make_extend_batch(rt, rpi, [0] * 3, [[1, 2], [3, 4, 5], [6]]))
    fb = make_decode_batch(rt, rpi, [2, 3, 1], [7, 8, 9])
    replays = backend.replays
    out = runner(fb).clone()
    assert backend.replays > replays
    torch.testing.assert_close(out, rt.forward(fb), rtol=1e-4, atol=1e-4)
