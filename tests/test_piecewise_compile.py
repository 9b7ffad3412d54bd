"""Piecewise compiled as the engines compile it (docs/dispatch.md): one Dynamo trace for
every size, a compile per piece, one warm-up per key, intermediate outputs held weakly,
and attention writing into a buffer the graph owns."""

from __future__ import annotations

import functools
import gc
import types
import weakref

import pytest
import torch

from prefill_cases import against_eager, make_prefill_runner, mixed_batches
from test_capture_modes import decode_runner, decode_steps, runtime, same_as_eager

from graphslot.graphs import TapeBackend
from graphslot.graphs.backend import GraphCaptureError
from graphslot.graphs.segments import EagerStep, owns_memory
from graphslot.runners.contract import statics
from graphslot.runners.piecewise import PiecewiseModule, capture_piecewise, compile_piecewise, default_compile_backend

make_runner = functools.partial(make_prefill_runner, capture="piecewise")


@torch.library.custom_op("graphslot_test::third", mutates_args=())
def third(x: torch.Tensor) -> torch.Tensor:  # a split op for the plain functions compiled here
    return x / 3


@third.register_fake
def _(x):
    return torch.empty_like(x)


def owned_per_key(runner):
    """Per key, the tensors its graph keeps alive besides the static ones."""
    declared = [s.buffer for s in runner.registry.active] + statics(runner.adapter)
    return {key: graph.owned_tensors(declared) for key, graph in runner.graphs.items()}


# ------------------------------------------------------------------------ one trace


def test_one_trace_for_every_decode_size_one_included():
    rt = runtime()
    runner = decode_runner(rt, "piecewise", max_bs=8, capture_bs=[8, 4, 2, 1])
    assert runner._forward.traces == 1 and list(runner.graphs) == [8, 4, 2, 1]
    (module,) = runner._forward.compiled_modules
    assert module.compiled_pieces == rt.config.num_layers + 1
    assert all(same_as_eager(rt, runner, fb) for fb in decode_steps(rt, sizes=(1, 3, 2, 4, 1)))
    assert runner._forward.traces == 1  # replays never trace


def test_one_trace_for_every_token_bucket_one_included():
    rt, _, runner = make_runner(token_buckets=[32, 8, 2, 1])
    assert runner.captured_fn.traces == 1
    against_eager(rt, runner, mixed_batches(rt, sizes=(1, 1, 2, 3), max_len=3))


def test_compile_piecewise_traces_a_function_once_for_any_size():
    def f(x):
        return torch.ops.graphslot_test.third(x * 3) + 1

    fn = compile_piecewise(f, ["graphslot_test::third"])
    for n in (7, 3, 1, 12):
        x = torch.arange(float(n))
        torch._dynamo.maybe_mark_dynamic(x, 0)
        assert torch.equal(fn(x), f(x))
    assert fn.traces == 1 and fn.compiled_modules[0].compiled_pieces == 2


# ------------------------------------------------------------------ the compilers


def test_the_tape_records_the_aot_eager_pieces_ops():
    rt, _, runner = make_runner(token_buckets=[16])
    graph = runner.graphs[16]
    assert runner.captured_fn.compile_backend == default_compile_backend("cpu") == "aot_eager"
    for piece in graph.segments:  # ATen ops, as AOTAutograd lowered them
        assert piece.ops and all(op.startswith(("aten.", "graphslot_ref.")) for op in piece.ops)
    assert "aten.bmm.default" in graph.segments[1].ops  # the RowLinear projections
    against_eager(rt, runner, mixed_batches(rt, sizes=(2, 5), max_len=3))  # bit for bit, every step replayed


def test_eager_pieces_compile_nothing_and_cuda_defaults_to_inductor():
    rt, _, runner = make_runner(token_buckets=[16], compile_backend="eager")
    assert runner.captured_fn.compiled_modules[0].compiled_pieces == 0
    against_eager(rt, runner, mixed_batches(rt, sizes=(3,), max_len=4))
    assert default_compile_backend("cuda") == "inductor"


def test_a_mutating_op_inside_a_compiled_piece_is_a_clear_tape_error():
    @torch.library.custom_op("graphslot_test::bump_", mutates_args=("x",))
    def bump_(x: torch.Tensor) -> None:
        x.add_(1)

    @bump_.register_fake
    def _(x):
        return None

    @torch.library.custom_op("graphslot_test::split_here", mutates_args=())
    def split_here(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @split_here.register_fake
    def _(x):
        return torch.empty_like(x)

    def f(x):
        y = x * 2
        torch.ops.graphslot_test.bump_(y)
        return torch.ops.graphslot_test.split_here(y)

    fn = compile_piecewise(f, ["graphslot_test::split_here"])
    x = torch.ones(4)
    with pytest.raises(GraphCaptureError, match=r"piece 0 \(submod_0, after the start\): the cpu graph backend "
                                                r"cannot record auto_functionalized"):
        capture_piecewise(TapeBackend(), lambda: fn(x), ["graphslot_test::split_here"])


# -------------------------------------------------------- what a key keeps, and copies


def test_a_key_keeps_its_last_output_and_nothing_else():
    rt, _, runner = make_runner()
    for key, owned in owned_per_key(runner).items():
        graph = runner.graphs[key]
        assert owned == [graph.output], key  # intermediates held weakly; attention returned nothing
        assert not any(owns_memory(t) for s in graph.segments[:-1] for t in torch.utils._pytree.tree_leaves(s.output))
    against_eager(rt, runner, mixed_batches(rt, sizes=(1, 4, 7), max_len=9))  # and the weak views still replay


def test_attention_writes_into_a_buffer_the_previous_piece_owns():
    rt, _, runner = make_runner(token_buckets=[16])
    graph = runner.graphs[16]
    for i, step in enumerate(graph.steps):
        if isinstance(step, EagerStep):
            assert step.outputs == []  # nothing to copy at replay
            (out,) = [a for a in step.args if isinstance(a, torch.Tensor) and a.shape == (16, 64)]
            assert out.untyped_storage().data_ptr() in graph.steps[i - 1].produced


def test_one_warm_up_per_key_not_one_per_piece(monkeypatch):
    runs = []
    original = PiecewiseModule.__call__
    monkeypatch.setattr(PiecewiseModule, "__call__", lambda self, *a: (runs.append(1), original(self, *a))[1])
    warmups = []

    class Watched(TapeBackend):
        def capture(self, fn, *, warmup=1, stream=None):
            warmups.append(warmup)
            return super().capture(fn, warmup=warmup, stream=stream)

    rt, _, runner = make_runner(backend=Watched(), warmup=2)
    assert len(runs) == len(runner.graphs) * (2 + 1)  # per key: two warm-ups and the capture pass
    assert warmups == [0] * (len(runner.graphs) * (rt.config.num_layers + 1))  # pieces: none of their own


# ------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_pieces_compile_once_with_inductor_and_keep_one_output_per_key():
    rt, _, runner = make_runner(device="cuda", token_buckets=[64, 32, 16, 8])
    assert runner.backend.name == "cuda" and runner.captured_fn.compile_backend == "inductor"
    assert runner.captured_fn.traces == 1
    (module,) = runner.captured_fn.compiled_modules
    assert module.compiled_pieces == rt.config.num_layers + 1
    for key, owned in owned_per_key(runner).items():
        assert owned == [runner.graphs[key].output], key
    against_eager(rt, runner, mixed_batches(rt, sizes=(1, 3, 8, 2), max_len=8))  # every step replayed


@pytest.mark.cuda
@cuda
def test_cuda_decode_pieces_one_trace_sizes_one_to_eight():
    rt = runtime("cuda")
    runner = decode_runner(rt, "piecewise", max_bs=8, capture_bs=[8, 4, 2, 1])
    assert runner._forward.traces == 1
    assert all(same_as_eager(rt, runner, fb) for fb in decode_steps(rt, sizes=(1, 3, 2, 4, 1)))


def test_an_unknown_compile_backend_names_the_choices():
    with pytest.raises(ValueError,
                       match=r"^unknown compile_backend 'inductr': choose one of inductor, aot_eager, eager"):
        make_runner(token_buckets=[16], compile_backend="inductr")


@pytest.mark.parametrize("failing, where", [(0, "piece 0 (submod_0, after the start)"),
                                            (1, "piece 1 (submod_2, after graphslot_test::third)")])
def test_a_compile_backend_that_raises_is_a_graphslot_error_naming_it_and_the_piece(failing, where):
    cause = ValueError("no kernel for aten.mul")
    compiled = []

    def refusing_backend(gm, example_inputs):
        compiled.append(gm)
        if len(compiled) > failing:
            raise cause
        return gm

    fn = compile_piecewise(lambda x: torch.ops.graphslot_test.third(x * 3) + 1, ["graphslot_test::third"],
                           compile_backend=refusing_backend)
    with pytest.raises(GraphCaptureError) as info:
        fn(torch.arange(4.0))
    assert str(info.value) == (
        f"{where}: compile_backend 'refusing_backend' raised ValueError: no kernel for aten.mul; "
        "compile the pieces with compile_backend='eager' (no compiler) to tell the backend's failure from the "
        "model's")
    assert info.value.__cause__ is cause
    assert not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)


class OutputsOnly:
    """A backend that keeps, as a CUDA graph does, nothing of a capture but its output
    (it runs the piece once; nothing here replays)."""

    name = "outputs-only"

    def __init__(self):
        self.outputs = []

    def capture(self, fn, *, warmup=1, stream=None):
        graph = types.SimpleNamespace(output=fn(), replay=lambda: None)
        leaves = torch.utils._pytree.tree_leaves(graph.output)
        self.outputs.append([weakref.ref(t) for t in leaves if isinstance(t, torch.Tensor)])
        return graph


def test_the_intermediates_are_freed_when_the_capture_pass_ends():
    rt, adapter, runner = make_runner(token_buckets=[16], lazy=True)
    dummy = adapter.make_dummy_batch(16)
    runner.registry.fill_from(dummy, raw_bs=0, padded_bs=0, raw_num_tokens=0, padded_num_tokens=16)
    view = runner.registry.extract(dummy, padded_bs=0, padded_num_tokens=16)
    adapter.init_capture_metadata(16, view)
    backend = OutputsOnly()
    was_enabled = gc.isenabled()
    gc.disable()  # as in a capture session: reference counts alone must free them
    try:
        graph = capture_piecewise(backend, lambda: runner.captured_fn(view.positions, view.input_embeds, view),
                                  runner.capture_mode.split_ops, warmup=1)
        alive = [any(ref() is not None for ref in refs) for refs in backend.outputs]
    finally:
        if was_enabled:
            gc.enable()
    assert alive == [False] * rt.config.num_layers + [True]  # only the last piece's output lives on
    assert graph.output is graph.segments[-1].output
