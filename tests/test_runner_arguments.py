"""Runner arguments refused at construction, naming the argument and the value (issue 44):
captured sizes and buckets that used to be cleaned silently (item 10), and a capture
context that is no factory of fresh context managers (item 11)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from test_capture_modes import decode_runner, prefill_runner, runtime

from graphslot.runners.capture import CAPTURE_MODES
from graphslot.runners.dispatch import capture_sizes
from graphslot.runners.prefill import token_buckets

RULE = ("capture_context must be a zero-argument callable returning a fresh context manager each call (a "
        "@contextlib.contextmanager function itself, sglang's graph_capture, lambda: my_context())")


# ------------------------------------------------------------- sizes and buckets (item 10)


@pytest.mark.parametrize("sizes, error, message", [
    ([1, 2, 8], ValueError, "capture_bs [1, 2, 8]: 8 is beyond max_bs 4 (no batch that large runs a graph): drop it, "
                            "or raise max_bs"),
    ([0, 2], ValueError, "capture_bs must be ints >= 1, got 0 in [0, 2]"),
    ([-3, 4], ValueError, "capture_bs must be ints >= 1, got -3 in [-3, 4]"),
    ([2.5, 4], TypeError, "capture_bs must hold ints, got 2.5 (float) in [2.5, 4]"),
    ([True, 4], TypeError, "capture_bs must hold ints, got True (bool) in [True, 4]"),
    ([2.0], TypeError, "capture_bs must hold ints, got 2.0 (float) in [2.0]"),
    (["2"], TypeError, "capture_bs must hold ints, got '2' (str) in ['2']"),
    (4, TypeError, "capture_bs must be a sequence of ints, got int 4"),
])
def test_bad_capture_bs_is_refused_at_construction(sizes, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        decode_runner(runtime(), "full", capture_bs=sizes)


def test_capture_bs_is_merged_and_sorted_and_numpy_like_ints_count():
    runner = decode_runner(runtime(), "full", capture_bs=[2, 1, 4, 2, torch.tensor(1).item()])
    assert runner.captured_sizes == [4, 2, 1]
    assert capture_sizes(8, [torch.tensor(3)]) == [3]  # anything with __index__


@pytest.mark.parametrize("buckets, error, message", [
    ([16.9, 32], TypeError, "token_buckets must hold ints, got 16.9 (float) in [16.9, 32]"),
    ([True, 16], TypeError, "token_buckets must hold ints, got True (bool) in [True, 16]"),
    ([0, -4, 16], ValueError, "token_buckets must be ints >= 1, got 0 in [0, -4, 16]"),
    ("16", TypeError, "token_buckets must be a sequence of ints, got str '16'"),
])
@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_bad_token_buckets_are_refused_at_construction(capture, buckets, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        prefill_runner(runtime(), capture, token_buckets=buckets)


def test_token_buckets_are_merged_and_sorted():
    assert token_buckets(256, [32, 16, 32]) == [32, 16]
    assert token_buckets(16, [64]) == [64]  # max_num_tokens caps the default schedule only


def test_bad_request_buckets_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"^request_buckets \[4, 16\]: 16 is beyond max_bs 8 "):
        prefill_runner(runtime(), "full", request_buckets=[4, 16])
    with pytest.raises(TypeError, match=r"^request_buckets must hold ints, got 2.5 \(float\) in \[2.5\]$"):
        prefill_runner(runtime(), "full", request_buckets=[2.5])


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("setting, value, error, message", [
    ("max_bs", 4.5, TypeError, "max_bs must be an int, got 4.5 (float)"),
    ("max_bs", -0.0, TypeError, "max_bs must be an int, got -0.0 (float)"),
    ("max_bs", 0, ValueError, "max_bs must be an int >= 1, got 0"),
    ("warmup", -1, ValueError, "warmup must be an int >= 0, got -1"),
    ("warmup", 1.5, TypeError, "warmup must be an int, got 1.5 (float)"),
    ("warmup", True, TypeError, "warmup must be an int, got True (bool)"),
    ("warmup", 10**9, ValueError, "warmup must be an int <= 100 (eager runs before each capture), got 1000000000"),
])
def test_bad_counts_are_refused_at_construction_naming_them(phase, setting, value, error, message):
    """``max_bs=4.0`` was taken as 4, ``-0.0`` failed as "no batch size to capture", and a
    negative warmup was taken as none."""
    make = decode_runner if phase == "decode" else prefill_runner
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        make(runtime(), "full", **{setting: value})


@pytest.mark.parametrize("setting, value, error, message", [
    ("num_tokens_per_bs", 1.5, TypeError, "num_tokens_per_bs must be an int, got 1.5 (float)"),
    ("num_tokens_per_bs", 0, ValueError, "num_tokens_per_bs must be an int >= 1, got 0"),
    ("capture_bs_multiple", 0, ValueError, "capture_bs_multiple must be an int >= 1, got 0"),
    ("capture_bs_multiple", 2.0, TypeError, "capture_bs_multiple must be an int, got 2.0 (float)"),
])
def test_bad_decode_counts_are_refused_at_construction_naming_them(setting, value, error, message):
    """``num_tokens_per_bs=1.5`` ran as 1 token per request, ``capture_bs_multiple=0`` as none."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        decode_runner(runtime(), "full", **{setting: value})


def test_numpy_counts_are_taken_as_ints():
    np = pytest.importorskip("numpy")
    runner = decode_runner(runtime(), "full", max_bs=np.int64(4), capture_bs_multiple=np.int32(2), warmup=np.int8(0))
    assert runner.captured_sizes == [4, 2]
    assert type(runner.config.max_bs) is int and type(runner.config.warmup) is int


# ------------------------------------------------------------------ capture_context (item 11)


@contextlib.contextmanager
def nothing():
    yield


class Reentrant:
    """A context manager that may be entered again and again."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("context, message", [
    (nothing(), f"{RULE}; got _GeneratorContextManager "),  # the context manager, not its factory
    (Reentrant(), f"{RULE}; got Reentrant "),
    (42, f"{RULE}; got int 42"),
    (lambda device: nothing(), f"{RULE}; got function "),
])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_capture_context_that_is_no_factory_is_refused_at_construction(phase, context, message):
    make = decode_runner if phase == "decode" else prefill_runner
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
        make(runtime(), "full", capture_context=context)


@pytest.mark.parametrize("made", [None, 3, "ctx"])
@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_a_capture_context_that_returns_no_context_manager_is_named(capture, made):
    with pytest.raises(TypeError, match=f"^capture_context\\(\\) returned {type(made).__name__} .*, not a context "
                                        f"manager; {re.escape(RULE)}$"):
        decode_runner(runtime(), capture, capture_context=lambda: made)


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_a_capture_context_that_returns_one_one_shot_object_each_time_is_named(capture):
    once = nothing()
    # The context is entered once per capture session: construction enters it, a recapture tries again.
    runner = decode_runner(runtime(), capture, capture_context=lambda: once)
    with pytest.raises(TypeError, match=r"^capture_context\(\) returned the same _GeneratorContextManager object as at "
                                        r"an earlier capture, and entering it again failed \(AttributeError: .*\): it "
                                        r"can be entered once only \(as a @contextmanager one\); " + re.escape(RULE)):
        runner.recapture()


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_good_capture_contexts_still_work(capture):
    shared = Reentrant()
    for context in (nothing, lambda: shared, Reentrant, contextlib.nullcontext, torch.no_grad):
        runner = decode_runner(runtime(), capture, capture_context=context)
        assert len(runner.graphs) == 3


class Swallowing:
    """A capture context whose ``__exit__`` suppresses whatever was raised inside it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


@pytest.mark.parametrize("capture", CAPTURE_MODES)
def test_a_capture_context_cannot_swallow_a_failed_capture(capture):
    """The context's ``__exit__`` returning True swallowed the forward's error: "full" kept
    ``None`` as the size's graph, and the construction succeeded."""
    rt = runtime()
    layer = rt.model.layers[1].mlp
    original = layer.forward
    fails = [True]

    def failing(*args):
        if fails:
            fails.pop()
            raise RuntimeError("the forward failed in the capture")
        return original(*args)

    layer.forward = failing
    with pytest.raises(RuntimeError, match="^the forward failed in the capture") as info:
        decode_runner(rt, capture, warmup=0, capture_context=Swallowing)
    note = ("graphslot: capture_context's context manager (Swallowing) suppressed this error (its __exit__ returned "
            "True); a capture that failed cannot be kept, so it propagates")
    # one capture session in every mode: the context sees the error and cannot swallow it
    assert getattr(info.value, "__notes__", []) == [note]


@pytest.mark.parametrize("compile_backend", [42, ["aot_eager"]])
def test_a_compile_backend_neither_a_name_nor_a_callable_is_refused_naming_it(compile_backend):
    """``compile_backend=42`` failed at the first capture, inside Dynamo, as "'int' object is
    not callable"."""
    with pytest.raises(TypeError, match=r"^compile_backend must be a Dynamo backend name .* got 42 \(int\)$"
                       if compile_backend == 42 else r"^compile_backend must be a Dynamo backend name"):
        prefill_runner(runtime(), "piecewise", compile_backend=compile_backend)
