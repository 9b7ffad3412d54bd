"""release() and recapture() are for between steps (issue 44, item 3): called during a
step -- from an adapter hook (an engine reacting to a KV resize in
``init_replay_metadata``), a step observer's ``after_fill``, or the forward itself --
they would drop or refill the buffers of a step that has fetched its graph already, and
the stale graph would replay anyway. Every runner, in every capture mode, refuses them
there with an error naming the call, and stays usable."""

from __future__ import annotations

import pytest
import torch
from test_capture_modes import decode_runner, decode_steps, prefill_runner, runtime, same_as_eager

from prefill_cases import against_eager, mixed_batches

from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners import DecodeGraphRunner, PrefillGraphRunner
from graphslot.runners.capture import CAPTURE_MODES

CALLS = ("release", "recapture")


def refused(call, phase):
    return (rf"^{call}\(\) was called during a {phase} step \(from an adapter hook such as init_replay_metadata, a "
            rf"step observer, or the forward\): the step has fetched its graph and filled its buffers, which "
            rf"{call}\(\) would drop or overwrite before the replay; call {call}\(\) between steps$")


class Meddling:
    """``init_replay_metadata`` calls ``meddle`` once first (set it to a runner's lifecycle call)."""

    meddle = None

    def init_replay_metadata(self, *args):
        meddle, self.meddle = self.meddle, None
        if meddle is not None:
            meddle()
        super().init_replay_metadata(*args)


class MeddlingDecode(Meddling, ReferenceDecodeAdapter):
    pass


class MeddlingPrefill(Meddling, ReferencePrefillAdapter):
    pass


class MeddlingObserver:
    def __init__(self, meddle):
        self.meddle = meddle

    def after_fill(self, raw_bs, padded_bs):
        meddle, self.meddle = self.meddle, None
        if meddle is not None:
            meddle()


def meddling_decode(capture, where, call):
    """A decode runner and its reference runtime; its first step will call ``call`` from ``where``."""
    rt = runtime()
    adapter = MeddlingDecode(rt)
    runner = DecodeGraphRunner(adapter, capture=capture, max_bs=4, capture_bs=[1, 2, 4], progress=False)
    if where == "hook":
        adapter.meddle = getattr(runner, call)
    else:
        runner.add_observer(MeddlingObserver(getattr(runner, call)))
    return rt, runner


@pytest.mark.parametrize("capture", CAPTURE_MODES)
@pytest.mark.parametrize("where", ["hook", "observer"])
@pytest.mark.parametrize("call", CALLS)
def test_release_or_recapture_during_a_decode_step_is_refused_and_the_runner_stays_usable(capture, where, call):
    rt, runner = meddling_decode(capture, where, call)
    keys = list(runner.graphs)
    steps = decode_steps(rt)
    fb = next(steps)
    with pytest.raises(RuntimeError, match=refused(call, "decode")):
        runner(fb)
    assert runner.steps_in_progress == 0 and list(runner.graphs) == keys and runner.generation == 0
    assert same_as_eager(rt, runner, fb)  # the same step again: nothing was dropped or refilled under it
    getattr(runner, call)()  # between steps: fine
    assert runner.generation == 1
    assert all(same_as_eager(rt, runner, fb, graph=call != "release") for fb in steps)
    assert runner.metrics()["replays"] == (1 if call == "release" else 6)


@pytest.mark.parametrize("call", CALLS)
def test_release_or_recapture_from_the_forward_during_a_replay_is_refused(call):
    rt = runtime()
    runner = decode_runner(rt, "breakable")  # attention runs eagerly between the segments, at every replay
    backend, original = rt.attn_backend, rt.attn_backend.forward
    meddles = [getattr(runner, call)]

    def forward(*args, **kwargs):
        if meddles:
            meddles.pop()()
        return original(*args, **kwargs)

    steps = decode_steps(rt)
    fb = next(steps)  # after the prefill, which runs the attention too
    backend.forward = forward
    with pytest.raises(RuntimeError, match=refused(call, "decode")):
        runner(fb)
    assert runner.steps_in_progress == 0 and runner.generation == 0
    assert all(same_as_eager(rt, runner, fb) for fb in [fb, *steps])


@pytest.mark.parametrize("capture", CAPTURE_MODES)
@pytest.mark.parametrize("call", CALLS)
def test_release_or_recapture_during_a_prefill_step_is_refused_and_the_runner_stays_usable(capture, call):
    rt = runtime()
    adapter = MeddlingPrefill(rt)
    kwargs = {"token_buckets": [16, 32], "lazy": False, "max_bs": 8, "progress": False}
    if capture == "full":
        kwargs["request_buckets"] = [4, 8]
    runner = PrefillGraphRunner(adapter, capture=capture, **kwargs)
    keys = list(runner.graphs)
    adapter.meddle = getattr(runner, call)
    batches = list(mixed_batches(rt, seed=3, sizes=(3, 2), max_len=6))
    with pytest.raises(RuntimeError, match=refused(call, "prefill")):
        runner(batches[0])
    assert runner.steps_in_progress == 0 and list(runner.graphs) == keys and runner.generation == 0
    against_eager(rt, runner, batches[:1])  # the same batch again: replayed on its own buffers
    getattr(runner, call)()
    if call == "release":
        assert not runner.can_run(batches[1]) and runner.graphs == {}
    else:
        against_eager(rt, runner, batches[1:])


def test_a_lazy_capture_in_a_step_is_part_of_the_step():
    rt = runtime()
    adapter = MeddlingDecode(rt)
    runner = DecodeGraphRunner(adapter, max_bs=4, capture_bs=[1, 2, 4], lazy=True, progress=False)
    original = adapter.init_capture_metadata
    adapter.init_capture_metadata = lambda *args: (runner.release(), original(*args))
    with pytest.raises(RuntimeError, match=refused("release", "decode")):
        runner(next(decode_steps(rt)))
    assert runner.steps_in_progress == 0


def test_a_step_prepared_before_a_release_or_recapture_is_refused_at_launch():
    rt = runtime()
    runner = decode_runner(rt, "full")
    steps = decode_steps(rt)
    fb = next(steps)
    for call in CALLS:
        staged = runner.prepare(fb)
        getattr(runner, call)()
        with pytest.raises(RuntimeError, match=r"^this step was prepared before a release\(\) or recapture\(\): its "
                                               r"graph and buffers are stale; prepare it again$"):
            runner.launch(staged)
    assert same_as_eager(rt, runner, fb)  # recaptured last: prepared again, it replays
    assert runner.metrics()["replays"] == 1


def test_a_prefill_runner_still_releases_and_recaptures_between_steps():
    rt = runtime()
    runner = prefill_runner(rt, "breakable", lazy=False, token_buckets=[32])
    runner.recapture()
    against_eager(rt, runner, mixed_batches(rt, seed=5, sizes=(2,)))
    runner.release()
    assert runner.graphs == {} and runner.generation == 2


def test_a_step_whose_buffers_another_prepare_or_step_filled_is_refused_at_launch():
    """The buffers hold the batch staged last: launching an earlier staged step replayed its
    graph on another batch's inputs and returned its rows as this batch's, without a word."""
    rt = runtime()
    runner = decode_runner(rt, "full")
    steps = decode_steps(rt)
    first = next(steps)
    second = next(steps)
    stale = r"^this step's buffers were filled again since it was prepared \(by another prepare\(\) or step\)"
    for refill in (runner.prepare, runner):
        staged = runner.prepare(first)
        refill(second)
        with pytest.raises(RuntimeError, match=stale):
            runner.launch(staged)
    staged = runner.prepare(first)
    out = runner.launch(staged).clone()
    assert torch.equal(runner.launch(staged), out)  # launched again, on its own buffers still
    assert same_as_eager(rt, runner, first)


@pytest.mark.parametrize("capture", CAPTURE_MODES)
@pytest.mark.parametrize("call", CALLS)
def test_release_or_recapture_during_a_recapture_is_refused_and_the_next_recapture_captures_every_size(capture,
                                                                                                        call):
    """Called from ``init_capture_metadata`` while ``recapture()`` captured, ``release()`` dropped
    the sizes captured so far and the recapture went on: it returned with size 4 missing, which
    ran eager from then on. Refused now; a recapture cut short leaves the runner released, and
    the next ``recapture()`` captures every size again."""
    rt = runtime()
    adapter = ReferenceDecodeAdapter(rt)
    runner = DecodeGraphRunner(adapter, capture=capture, max_bs=4, capture_bs=[1, 2, 4], progress=False)
    original = adapter.init_capture_metadata
    calls = []

    def meddling(*args):
        calls.append(args)
        if len(calls) == 2:
            getattr(runner, call)()
        return original(*args)

    adapter.init_capture_metadata = meddling
    with pytest.raises(RuntimeError, match=rf"^{call}\(\) was called during a capture of decode graphs \(from an "
                                           rf"adapter hook such as init_capture_metadata, or the forward\)"):
        runner.recapture()
    adapter.init_capture_metadata = original
    assert runner.graphs == {} and runner.released
    runner.recapture()
    assert sorted(runner.graphs) == [1, 2, 4]
    assert all(same_as_eager(rt, runner, fb) for fb in decode_steps(rt))
    assert runner.metrics()["eager_fallbacks"] == 0
