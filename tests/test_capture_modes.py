"""Phase x capture mode: decode and prefill, each captured "full", "breakable" or
"piecewise", give the eager tokens (bit for bit on the tape), with the batch size and
token count changing every step, padded sizes included; the engine's pool and capture
context; release() and recapture() (issue 33, docs/api.md "Runners").

On one reference runtime a prefill runner is built before a decode runner: the static
attention metadata grows to the larger, and growing moves it.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from torch import nn

from graph_counting import replays_one_step
from prefill_cases import against_eager, backend_graphs, mixed_batches

from graphslot.graphs import CudaGraphBackend, SegmentedGraph, TapeBackend, TapeGraph, get_graph_backend, graph_pool
from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.numerics import output_check
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import DecodeGraphRunner, PrefillGraphRunner
from graphslot.runners.capture import CAPTURE_MODES

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: Decode batch sizes, one step each: every captured size (1, 2, 4) and a padded 3.
DECODE_SIZES = (3, 1, 4, 2, 3, 4)


def runtime(device="cpu"):
    return build_reference_model(device=device, max_num_reqs=64)


def decode_runner(rt, capture, **kwargs):
    """The backend counts its graphs' replays (``runner.backend.replays``)."""
    kwargs = {"max_bs": 4, "capture_bs": [1, 2, 4], "progress": False, **kwargs}
    return DecodeGraphRunner(ReferenceDecodeAdapter(rt), capture=capture, **kwargs)


def prefill_runner(rt, capture, **kwargs):
    kwargs = {"max_bs": 8, "token_buckets": [16, 32, 64], "progress": False, "lazy": True, **kwargs}
    if capture == "full":
        kwargs.setdefault("request_buckets", [4, 8])
    return PrefillGraphRunner(ReferencePrefillAdapter(rt), capture=capture, **kwargs)


def decode_steps(rt, sizes=DECODE_SIZES, seed=0):
    """Decode batches of ``sizes[i]`` requests (the first of four prefilled ones), each one
    token longer than the last time it ran."""
    rng = random.Random(seed)
    rpi = rt.req_to_token_pool.alloc(4)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randint(2, 6))] for _ in rpi]
    rt.forward(make_extend_batch(rt, rpi, [0] * 4, prompts))
    lens = [len(p) for p in prompts]
    for bs in sizes:
        yield make_decode_batch(rt, rpi[:bs], lens[:bs], [rng.randrange(1, 128) for _ in range(bs)])
        lens[:bs] = [n + 1 for n in lens[:bs]]


def same_as_eager(rt, runner, fb, graph=None):
    """The runner first, then eager (which rewrites the same K/V slots identically). A
    step the runner can run must replay a graph, as the backend counts; else none.
    ``graph``: whether it must replay one (None: whether the runner can run it)."""
    replays = runner.backend.replays
    graphs = runner.can_run(fb) if graph is None else graph
    out = runner(fb).clone()
    if graphs:
        graph = runner.graph(runner.padded_bs(fb), runner.padded_context(fb))
        assert runner.backend.replays - replays == backend_graphs(graph), "the backend replayed no graph"
    else:
        assert runner.backend.replays == replays, "an eager step replayed a graph"
    return output_check(rt.device)(out, rt.forward(fb))


# --------------------------------------------------------------- phase x mode == eager


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_decode_in_every_capture_mode_equals_eager(capture):
    rt = runtime()
    runner = decode_runner(rt, capture)
    assert [same_as_eager(rt, runner, fb) for fb in decode_steps(rt)] == [True] * len(DECODE_SIZES)
    metrics = runner.metrics()
    assert metrics["eager_reasons"] == {} and metrics["replays"] == len(DECODE_SIZES)
    assert metrics["padded_rows"] == 2  # the two steps of 3 ran the graph of 4
    layers = rt.config.num_layers
    for graph in runner.graphs.values():
        if capture == "full":  # attention inside the graph
            assert isinstance(graph, TapeGraph)
        else:  # attention eager between segments or pieces
            assert (graph.num_segments, graph.num_eager_steps) == (layers + 1, layers)


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_target_verify_in_every_capture_mode_equals_eager(capture):
    rt = runtime()
    runner = decode_runner(rt, capture, capture_bs=[2, 4], num_tokens_per_bs=2)
    rpi = rt.req_to_token_pool.alloc(3)
    rt.forward(make_extend_batch(rt, rpi, [0] * 3, [[1, 2, 3], [4, 5], [6, 7, 8, 9]]))
    fb = make_decode_batch(rt, rpi, [3, 2, 4], [[10, 11], [12, 13], [14, 15]])  # 3 requests: padded to 4
    assert same_as_eager(rt, runner, fb) and runner.metrics()["replays_per_size"] == {"4": 1}


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_prefill_in_every_capture_mode_equals_eager(capture):
    rt = runtime()
    runner = prefill_runner(rt, capture)
    batches = list(mixed_batches(rt, sizes=(1, 3, 8, 2, 5), max_len=10))
    used = against_eager(rt, runner, batches)  # asserts each batch
    assert any(n < bucket for n, bucket in used), "no batch needed token padding"
    if capture == "full":  # keyed by request slots too, the padded ones zero-length rows
        assert {runner.request_slots(fb) for fb in batches} == {4, 8}
        assert all(isinstance(key, tuple) and isinstance(g, TapeGraph) for key, g in runner.graphs.items())
    else:
        assert runner.request_buckets is None and all(isinstance(key, int) for key in runner.graphs)
    assert runner.graphs and runner.backend.replays >= len(used)  # each step replayed one graph at least


def test_an_unknown_capture_mode_names_the_choices():
    with pytest.raises(ValueError, match=r"^unknown capture mode 'fused'; choose one of: full, breakable, piecewise$"):
        decode_runner(runtime(), "fused")


def test_piecewise_refuses_shared_outputs():
    with pytest.raises(ValueError, match="share_outputs=True needs capture='full' or 'breakable'"):
        decode_runner(runtime(), "piecewise", share_outputs=True)


# ----------------------------------------------------------- the engine's capture context


class CountingContext:
    """A capture-context factory that counts how often it was entered, checks each entry
    is left before the next, and yields what sglang's ``graph_capture()`` yields: an
    object with the capture ``.stream`` (here a token)."""

    def __init__(self):
        self.entries, self.open = 0, False
        self.stream = object()

    @contextlib.contextmanager
    def __call__(self):
        assert not self.open, "capture contexts nest"
        self.entries, self.open = self.entries + 1, True
        try:
            yield self
        finally:
            self.open = False


class WatchedBackend(TapeBackend):
    """The tape, noting at each capture whether the engine's context is open and the
    stream it was asked to capture on."""

    def __init__(self, context):
        super().__init__()
        self.context, self.inside, self.streams = context, [], []

    def begin_capture(self, stream=None):  # every tape capture, whole or segment, begins here
        self.inside.append(self.context.open)
        self.streams.append(stream)
        return super().begin_capture(stream)


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_the_capture_context_is_entered_once_per_capture_run_and_its_stream_used(capture):
    rt = runtime()
    pre_ctx, dec_ctx = CountingContext(), CountingContext()
    backend = WatchedBackend(dec_ctx)
    prefill = prefill_runner(rt, capture, capture_context=pre_ctx, lazy=False, token_buckets=[16, 32])
    decode = decode_runner(rt, capture, capture_context=dec_ctx, backend=backend)
    graphs = sum(backend_graphs(g) for g in decode.graphs.values())
    assert graphs == (3 if capture == "full" else 3 * 3)  # 3 sizes; 2 layers: 3 segments or pieces each
    assert len(prefill.graphs) == (4 if capture == "full" else 2) and (pre_ctx.entries, dec_ctx.entries) == (1, 1)
    assert not (pre_ctx.open or dec_ctx.open)
    assert len(backend.inside) == graphs and all(backend.inside)  # every capture inside the one entry
    assert set(map(id, backend.streams)) == {id(dec_ctx.stream)}  # on the stream the context yielded
    decode.recapture()
    assert dec_ctx.entries == 2 and len(backend.inside) == 2 * graphs and all(backend.inside)
    lazy = decode_runner(rt, capture, capture_context=dec_ctx, backend=backend, lazy=True)
    assert same_as_eager(rt, lazy, next(decode_steps(rt, sizes=(3,))))
    assert dec_ctx.entries == 3  # a lazy capture of one key is a session of its own


# ------------------------------------------------------------------------- the pool


def test_one_pool_shared_by_every_runner_of_a_process():
    rt = runtime()
    pool = graph_pool("cpu")
    prefill = prefill_runner(rt, "breakable", graph_pool=pool)
    decode = decode_runner(rt, "full", graph_pool=pool)
    assert decode.graph_pool is prefill.graph_pool is pool
    own = decode_runner(runtime(), "full")
    assert own.graph_pool is not pool and own.graph_pool is not None  # not given: the backend's own


def test_a_pool_handle_goes_to_the_backend_made_from_a_name():
    token = graph_pool("cpu")
    assert get_graph_backend("cpu", "cpu", pool=token).pool is token
    assert CudaGraphBackend("cuda", pool=token).pool is token  # no CUDA touched: the handle is kept
    with pytest.raises(TypeError, match=r"^the tape's graph pool must be a TapePool"):
        TapeBackend(pool="mine")


def test_a_backend_object_is_used_as_it_is():
    pool = graph_pool("cpu")
    backend = TapeBackend(pool=pool)
    runner = decode_runner(runtime(), "full", backend=backend, graph_pool=pool)
    assert runner.backend is backend and runner.graph_pool is pool
    with pytest.raises(ValueError, match=r"^graph_pool= differs from the pool of the graph backend given \('cpu'\)"):
        decode_runner(runtime(), "full", backend=TapeBackend(), graph_pool=pool)
    with pytest.raises(TypeError, match="neither a name .* nor an object with the GraphBackend protocol"):
        decode_runner(runtime(), "full", backend=object())


# ------------------------------------------------------------------------ lifecycle


def buffer_addresses(runner):
    return {s.name: s.buffer.data_ptr() for s in runner.registry.active}


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_release_then_steps_run_eager_and_recapture_replays_again(capture):
    rt = runtime()
    runner = decode_runner(rt, capture)
    addresses, keys = buffer_addresses(runner), list(runner.graphs)
    steps = decode_steps(rt)
    assert same_as_eager(rt, runner, next(steps))
    runner.release()
    assert runner.graphs == {} and runner.released
    assert all(not s.buffer.any() for s in runner.registry.active if s.resolved.index)  # reset
    fb = next(steps)
    assert runner.eager_reason(fb) == "graphs released" and same_as_eager(rt, runner, fb, graph=False)
    runner.recapture()
    assert list(runner.graphs) == keys and not runner.released
    assert all(same_as_eager(rt, runner, fb) for fb in steps)
    assert runner.metrics()["eager_reasons"] == {"graphs released": 1}
    assert buffer_addresses(runner) == addresses


def test_a_lazy_runner_captures_again_on_demand_after_release():
    rt = runtime()
    runner = decode_runner(rt, "full", lazy=True)
    steps = decode_steps(rt, sizes=(3, 3))
    assert same_as_eager(rt, runner, next(steps)) and list(runner.graphs) == [4]
    runner.release()
    assert runner.graphs == {} and not runner.released
    assert same_as_eager(rt, runner, next(steps)) and list(runner.graphs) == [4]
    assert runner.metrics()["eager_reasons"] == {}


def replace_weight(rt):
    """A new Parameter for one weight inside the layer stack (what a weight reload does)."""
    proj = rt.model.layers[0].mlp.down_proj
    proj.weight = nn.Parameter(proj.weight * 1.5, requires_grad=False)


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_recapture_after_a_weight_reload_replays_the_new_weights(capture):
    rt = runtime()
    prefill = prefill_runner(rt, capture, lazy=False, token_buckets=[32], request_buckets=[4])
    decode = decode_runner(rt, capture)
    addresses = buffer_addresses(decode), buffer_addresses(prefill)
    steps = decode_steps(rt)
    assert same_as_eager(rt, decode, next(steps))
    replace_weight(rt)
    # The graphs read the weight they were captured with: stale.
    assert not same_as_eager(rt, decode, next(steps))
    batch = next(mixed_batches(rt, seed=7, sizes=(3,)))
    with replays_one_step(prefill):
        stale = prefill(batch)
    assert not torch.equal(stale, rt.forward(batch))
    decode.recapture()
    prefill.recapture()
    assert all(same_as_eager(rt, decode, fb) for fb in steps)
    against_eager(rt, prefill, mixed_batches(rt, seed=8, sizes=(2, 4)))
    assert (buffer_addresses(decode), buffer_addresses(prefill)) == addresses


def test_a_weight_changed_in_place_needs_no_recapture():
    rt = runtime()
    runner = decode_runner(rt, "full")
    steps = decode_steps(rt)
    with torch.no_grad():
        rt.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # same tensor: the graph reads it
    assert all(same_as_eager(rt, runner, fb) for fb in steps)


def reached_weights(rt):
    """A weight reached each way the reference model reaches one: the Parameter itself
    (the embedding, an RMSNorm), through a view taken at capture (``weight.t()`` of a
    linear layer) and a buffer (RoPE's cos/sin table)."""
    model = rt.model
    return {"embedding": model.embed_tokens.weight, "rmsnorm": model.layers[0].input_layernorm.weight,
            "linear": model.layers[0].mlp.down_proj.weight, "buffer": model.rotary.cos_sin_cache}


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_weights_rebound_without_recapture_stay_stale_as_on_a_gpu(capture):
    """``p.data = new`` (a weight loader) is not seen by a graph, which reads the memory it was
    captured with; an in-place write is; recapture() reads the new tensors. Issue 44."""
    rt = runtime()
    runner = decode_runner(rt, capture)
    steps = decode_steps(rt, sizes=(3, 1, 4, 2) * 4)
    for name, weight in reached_weights(rt).items():
        old = weight.data
        weight.data = old * 1.5 + 0.25
        fb = next(steps)
        out = runner(fb).clone()
        fresh = rt.forward(fb)
        weight.data = old  # eager on the old storage: what a stale graph computes
        assert not torch.equal(out, fresh) and torch.equal(out, rt.forward(fb)), name
        with torch.no_grad():
            old.copy_(old * 1.5 + 0.25)  # in place: seen without recapture
        assert same_as_eager(rt, runner, next(steps)), name
    for weight in reached_weights(rt).values():
        weight.data = weight.data * 0.5
    assert not same_as_eager(rt, runner, next(steps))
    runner.recapture()
    assert same_as_eager(rt, runner, next(steps)) and same_as_eager(rt, runner, next(steps))


# ------------------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_every_capture_mode_on_cuda_graphs_matches_eager_in_one_shared_pool(capture):
    rt = runtime("cuda")
    pool = graph_pool("cuda")
    prefill = prefill_runner(rt, capture, graph_pool=pool, lazy=False, token_buckets=[16, 32, 64])
    decode = decode_runner(rt, capture, graph_pool=pool)
    assert decode.graph_pool is prefill.graph_pool is pool and decode.backend.name == "cuda"
    for runner in (prefill, decode):
        for graph in runner.graphs.values():
            for part in (graph.segments if isinstance(graph, SegmentedGraph) else [graph]):
                assert part.pool is pool
    against_eager(rt, prefill, mixed_batches(rt, sizes=(1, 3, 8), max_len=10))
    assert all(same_as_eager(rt, decode, fb) for fb in decode_steps(rt))
    decode.recapture()
    assert all(same_as_eager(rt, decode, fb) for fb in decode_steps(rt, seed=1))
    decode.release()
    assert decode.graphs == {} and decode.graph_pool is pool
