"""ContinuousBatcher: a step is all or nothing, aborts during a step wait for its end,
and requests and arguments are refused up front.

Every case runs one fixed schedule of four requests (a tiny random-weight Llama, CPU
tape backend) and compares with the same schedule run without the disturbance: the
tokens, every step's logits (exactly) and the pool's free slot and row counts after
every step.
"""

from __future__ import annotations

import functools
import itertools
import threading

import pytest

transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402 - transformers depends on numpy
import torch  # noqa: E402

from graphslot.integrations.transformers import ContinuousBatcher, greedy, tiny_model  # noqa: E402

#: step -> requests (prompt, max_new_tokens) added before it. With max_bs=4: request 1
#: finishes at step 2, request 3 at step 3, requests 0 and 2 at step 4. Step 2 prefills
#: request 3 and decodes all four; step 3 only decodes.
SCHEDULE = {0: [([5, 17, 3, 99, 42], 6), ([7, 7, 1], 4)], 1: [([64, 2, 31, 8], 5)], 2: [([11, 120], 3)]}
STEPS = 5


class Boom(Exception):
    """The injected failure."""


class Flaky:
    """``target`` that raises :class:`Boom` on its call number ``fail_at``, after doing its
    work (so whatever the call wrote to the KV pool was written)."""

    def __init__(self, target, fail_at=0):
        self.target, self.fail_at, self.calls = target, fail_at, itertools.count()

    def __call__(self, *args, **kwargs):
        result = self.target(*args, **kwargs)
        if next(self.calls) == self.fail_at:
            raise Boom("injected")
        return result

    def __getattr__(self, name):
        return getattr(self.target, name)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, **kwargs):
    kwargs.setdefault("mix_prefill", False)  # the schedule below: a request decodes in the step that admits it
    return ContinuousBatcher(model, max_bs=4, max_context_len=16, backend="cpu", capture_bs=[4], **kwargs)


def snapshot(engine):
    """Everything a step may change."""
    return ([r.rid for r in engine.waiting], [r.rid for r in engine.running],
            {rid: (list(r.output), r.row, list(r.slots), r.finished) for rid, r in engine.requests.items()},
            engine.cache.available_slots, engine.cache.available_requests)


def run(engine, before_step=None, abort_after=None):
    """Run SCHEDULE to the end. ``before_step(engine, k)`` may set up step ``k``; when it
    returns True the step must raise :class:`Boom` leaving the engine as it was, and is
    retried. ``abort_after=(k, rid)`` aborts ``rid`` between steps ``k`` and ``k + 1``.

    Returns the outputs by rid, ``(free slots, free rows)`` after each step (and abort),
    and each step's :class:`StepOutput`."""
    counts, outs = [], []
    for k in range(STEPS):
        for prompt, n in SCHEDULE.get(k, ()):
            engine.add_request(prompt, max_new_tokens=n)
        if before_step is not None and before_step(engine, k):
            before = snapshot(engine)
            with pytest.raises(Boom, match="^injected$"):
                engine.step()
            assert snapshot(engine) == before, f"the failed step {k} changed the engine"
        outs.append(engine.step())
        if abort_after is not None and abort_after[0] == k:
            engine.abort(abort_after[1])
        counts.append((engine.cache.available_slots, engine.cache.available_requests))
    assert engine.done
    return {rid: r.output for rid, r in engine.requests.items()}, counts, outs


@functools.cache
def reference(model, abort_after=None):
    return run(make_engine(model), abort_after=abort_after)


def assert_same_run(got, want):
    (outputs, counts, outs), (ref_outputs, ref_counts, ref_outs) = got, want
    assert outputs == ref_outputs
    assert counts == ref_counts
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.prefill_logits.keys() == ref.prefill_logits.keys() and out.decode.keys() == ref.decode.keys()
        for rid, logits in out.prefill_logits.items():
            assert torch.equal(logits, ref.prefill_logits[rid])
        for rid, (token, logits) in out.decode.items():
            assert token == ref.decode[rid][0] and torch.equal(logits, ref.decode[rid][1])
        assert out.finished == ref.finished and out.decode_batch_size == ref.decode_batch_size


def test_the_schedule_has_the_shape_the_cases_rely_on(model):
    outputs, counts, outs = reference(model)
    assert {rid: len(tokens) for rid, tokens in outputs.items()} == {0: 6, 1: 4, 2: 5, 3: 3}
    assert [sorted(o.prefill_logits) for o in outs] == [[0, 1], [2], [3], [], []]
    assert [o.decode_batch_size for o in outs] == [2, 3, 4, 3, 2]
    assert [o.finished for o in outs] == [[], [], [1], [3], [0, 2]]
    assert counts[-1] == (4 * 16, 4)  # everything went back
    assert len({t for tokens in outputs.values() for t in tokens}) > 5  # not one repeated token


# ------------------------------------------------------------- a failed step


def fail(where, at_step, call=0):
    """A ``before_step`` that makes ``where`` raise once (on its call ``call``) at step ``at_step``."""
    def before_step(engine, k):
        if k != at_step:
            return False
        if where == "sample":
            engine.sample = Flaky(greedy, call)
        elif where == "sampler":  # the built-in sampler picked the tokens (on the device), then the step failed
            engine.sampler = Flaky(engine.sampler, call)
        elif where == "runner":  # the decode forward (graph replay) ran and wrote the pool
            engine.runner = Flaky(engine.runner.target if isinstance(engine.runner, Flaky) else engine.runner)
        else:  # the prefill forward ran and wrote the pool
            engine.model = Flaky(engine.model.target if isinstance(engine.model, Flaky) else engine.model)
        return True
    return before_step


@pytest.mark.parametrize("where, at_step, call", [
    ("sample", 2, 0), ("sample", 2, 1), ("sample", 3, 0), ("sampler", 2, 0), ("sampler", 2, 1), ("sampler", 3, 0),
    ("runner", 2, 0), ("runner", 3, 0), ("model", 0, 0), ("model", 2, 0),
], ids=["sample-in-prefill", "sample-in-decode", "sample-decode-only-step", "sampler-in-prefill",
        "sampler-in-decode", "sampler-decode-only-step", "runner-with-prefill", "runner-decode-only-step",
        "prefill-first-step", "prefill-with-running"])
def test_a_failed_step_changes_nothing_and_the_retry_gives_the_uninterrupted_tokens(model, where, at_step, call):
    assert_same_run(run(make_engine(model), fail(where, at_step, call)), reference(model))


def test_every_step_failing_once_still_gives_the_uninterrupted_run(model):
    def before_step(engine, k):  # the prefill fails in the steps that admit, the decode in the others
        return fail("model" if k in SCHEDULE else "runner", k)(engine, k)

    assert_same_run(run(make_engine(model), before_step), reference(model))


def test_a_keyboard_interrupt_rolls_back_too(model):
    engine = make_engine(model)
    for k in range(2):
        for prompt, n in SCHEDULE[k]:
            engine.add_request(prompt, max_new_tokens=n)
        engine.step()
    engine.add_request(*SCHEDULE[2][0])
    before = snapshot(engine)

    def interrupted(logits):
        raise KeyboardInterrupt

    engine.sample = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert snapshot(engine) == before


@pytest.mark.parametrize("bad, error, message", [
    (lambda logits: greedy(logits)[:-1], ValueError, "sample must return one token id per row of logits: got 0 for 1"),
    (lambda logits: [128] * logits.shape[0], ValueError,
     "sample(logits)[0] is 128, outside the model's vocabulary (0 <= id < 128)"),
    (lambda logits: [1.0] * logits.shape[0], TypeError, "sample(logits)[0] is 1.0 (float); token ids must be integers"),
], ids=["too-few", "out-of-vocabulary", "floats"])
def test_what_sample_returns_is_checked_before_anything_changes(model, bad, error, message):
    def before_step(engine, k):
        if k == 2:
            engine.sample = bad
            before = snapshot(engine)
            with pytest.raises(error) as info:
                engine.step()
            assert str(info.value) == message
            assert snapshot(engine) == before
            engine.sample = greedy
        return False

    assert_same_run(run(make_engine(model), before_step), reference(model))


def test_a_tensor_from_sample_is_taken_like_a_list(model):
    engine = make_engine(model, sample=lambda logits: logits.argmax(-1))
    assert_same_run(run(engine), reference(model))


def test_step_from_inside_sample_is_refused_and_rolls_back(model):
    def before_step(engine, k):
        if k == 1:
            def reenter(logits):
                engine.step()

            engine.sample = reenter
            before = snapshot(engine)
            with pytest.raises(RuntimeError) as info:
                engine.step()
            assert str(info.value) == ("ContinuousBatcher.step() is already running: call it from one thread at "
                                       "a time, and not from sample")
            assert snapshot(engine) == before
            engine.sample = greedy
        return False

    assert_same_run(run(make_engine(model), before_step), reference(model))


# ------------------------------------------------------------- abort during a step


def aborting_sample(engine, rid, call):
    """greedy, aborting ``rid`` on its call number ``call``."""
    calls = itertools.count()

    def sample(logits):
        if next(calls) == call:
            engine.abort(rid)
        return greedy(logits)
    return sample


@pytest.mark.parametrize("call, victim", [(0, 0), (0, 3), (1, 2), (1, 1)],
                         ids=["running-request-during-prefill", "request-being-prefilled",
                              "request-in-the-decode", "request-on-its-last-token"])
def test_abort_from_inside_sample_takes_effect_at_the_end_of_the_step(model, call, victim):
    def before_step(engine, k):
        if k == 2:
            engine.sample = aborting_sample(engine, victim, call)
        return False

    engine = make_engine(model)
    got = run(engine, before_step)
    assert_same_run(got, reference(model, abort_after=(2, victim)))
    finishes_anyway = victim == 1  # its last token is in step 2: it finishes, the abort is a no-op
    assert got[2][2].aborted == ([] if finishes_anyway else [victim])
    assert engine.requests[victim].finished and engine.requests[victim].slots == []
    assert [o.aborted for i, o in enumerate(got[2]) if i != 2] == [[]] * (STEPS - 1)


def test_abort_from_another_thread_while_a_step_runs(model):
    inside, released = threading.Event(), threading.Event()
    errors = []

    def client(engine):
        assert inside.wait(30)
        try:
            engine.abort(0)  # must return at once: the step is still running
        except Exception as exc:  # the test reports it below
            errors.append(exc)
        released.set()

    def before_step(engine, k):
        if k == 2:
            def sample(logits):
                if not inside.is_set():  # the prefill of request 3; request 0 is running
                    inside.set()
                    assert released.wait(30), "abort() blocked while the step ran"
                return greedy(logits)

            engine.sample = sample
            threading.Thread(target=client, args=(engine,), daemon=True).start()
        return False

    engine = make_engine(model)
    got = run(engine, before_step)
    assert errors == []
    assert_same_run(got, reference(model, abort_after=(2, 0)))
    assert got[2][2].aborted == [0]


def test_abort_during_a_failed_step_still_takes_effect(model):
    def before_step(engine, k):
        if k == 2:
            def sample(logits):
                engine.abort(2)
                raise Boom("injected")

            engine.sample = sample
            before = snapshot(engine)
            with pytest.raises(Boom):
                engine.step()
            engine.sample = greedy
            assert engine.requests[2].finished
            waiting, running, requests, slots, rows = before
            # request 3 is still first in line; request 2 left the batch
            assert snapshot(engine)[:2] == (waiting, [rid for rid in running if rid != 2])
            assert (engine.cache.available_slots, engine.cache.available_requests) == (
                slots + len(requests[2][2]), rows + 1)  # the aborted request's row and slots came back
        return False

    (outputs, counts, outs), (ref_outputs, ref_counts, ref_outs) = (run(make_engine(model), before_step),
                                                                     reference(model, abort_after=(1, 2)))
    # as if aborted between steps 1 and 2 (the pool counts after step 1 were taken before the abort)
    assert_same_run((outputs, counts[2:], outs), (ref_outputs, ref_counts[2:], ref_outs))


def test_abort_names_an_unknown_request_and_leaves_a_finished_one_alone(model):
    engine = make_engine(model)
    with pytest.raises(KeyError) as info:
        engine.abort(7)
    assert info.value.args == ("abort: no request 7 (request ids are the rid of what add_request returned)",)
    req = engine.add_request([1, 2], max_new_tokens=2)
    waiting = engine.add_request([3], max_new_tokens=2)
    engine.abort(waiting.rid)
    engine.abort(waiting.rid)
    assert waiting.finished and list(engine.waiting) == [req]
    while not engine.done:
        engine.step()
    output = list(req.output)
    engine.abort(req.rid)
    assert req.output == output and len(output) == 2
    assert (engine.cache.available_slots, engine.cache.available_requests) == (4 * 16, 4)

    def sample(logits):
        engine.abort(99)

    engine.sample = sample
    engine.add_request([1], max_new_tokens=2)
    with pytest.raises(KeyError) as info:
        engine.step()
    assert info.value.args == ("abort: no request 99 (request ids are the rid of what add_request returned)",)


def test_eos_ends_a_request_at_that_token(model):
    outputs, _, _ = reference(model)
    eos = outputs[0][2]
    got, counts, _ = run(make_engine(model, eos_token_id=np.int64(eos)))
    for rid, tokens in outputs.items():
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert got[rid] == tokens[:cut]
    assert len(got[0]) == 3 and counts[-1] == (4 * 16, 4)


# ------------------------------------------------------------- refusals


@pytest.mark.parametrize("prompt, max_new_tokens, error, message", [
    ([1, 2.5], 2, TypeError, "add_request: prompt[1] is 2.5 (float); token ids must be integers"),
    ([1.0], 2, TypeError, "add_request: prompt[0] is 1.0 (float); token ids must be integers"),
    (torch.tensor([3.0, 4.0]), 2, TypeError, "add_request: prompt[0] is 3.0 (float); token ids must be integers"),
    ([True, 2], 2, TypeError, "add_request: prompt[0] is True (bool); token ids must be integers"),
    ([3, torch.tensor(True)], 2, TypeError,
     "add_request: prompt[1] is tensor(True) (Tensor); token ids must be integers"),
    ([3, np.bool_(True)], 2, TypeError, "add_request: prompt[1] is np.True_ (bool); token ids must be integers"),
    (["a"], 2, TypeError, "add_request: prompt[0] is 'a' (str); token ids must be integers"),
    ([5, 128], 2, ValueError, "add_request: prompt[1] is 128, outside the model's vocabulary (0 <= id < 128)"),
    ([1, 2, -1], 2, ValueError, "add_request: prompt[2] is -1, outside the model's vocabulary (0 <= id < 128)"),
    (5, 2, TypeError, "add_request: prompt must be a sequence of token ids, got int"),
    ([], 2, ValueError, "add_request: the prompt is empty; a request needs at least one token"),
    ([1, 2], 2.5, TypeError, "add_request: max_new_tokens must be an int >= 1, got 2.5"),
    ([1, 2], True, TypeError, "add_request: max_new_tokens must be an int >= 1, got True"),
    ([1, 2], 0, ValueError, "add_request: max_new_tokens must be an int >= 1, got 0"),
    ([1, 2], 16, ValueError, ("add_request: a request of 2 prompt tokens and 16 new tokens needs 17 cache "
                              "positions, more than max_context_len=16")),
])
def test_a_request_is_refused_naming_what_is_wrong(model, prompt, max_new_tokens, error, message):
    engine = make_engine(model)
    with pytest.raises(error) as info:
        engine.add_request(prompt, max_new_tokens=max_new_tokens)
    assert str(info.value) == message
    assert engine.requests == {} and not engine.waiting


def test_integral_scalars_are_token_ids(model):
    engine = make_engine(model)
    for prompt in ([np.int64(3), torch.tensor(4), 5], torch.tensor([3, 4, 5]), np.array([3, 4, 5], dtype=np.int32)):
        req = engine.add_request(prompt, max_new_tokens=np.int64(2))
        assert req.prompt == [3, 4, 5] and {type(t) for t in req.prompt} == {int} and type(req.max_new_tokens) is int
    while not engine.done:
        engine.step()
    assert len({tuple(r.output) for r in engine.requests.values()}) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_bs": 0}, ValueError, "ContinuousBatcher: max_bs must be an int >= 1, got 0"),
    ({"max_bs": 2.0}, TypeError, "ContinuousBatcher: max_bs must be an int >= 1, got 2.0"),
    ({"max_requests": 0}, ValueError, "ContinuousBatcher: max_requests must be an int >= 1, got 0"),
    ({"max_requests": "4"}, TypeError, "ContinuousBatcher: max_requests must be an int >= 1, got '4'"),
    ({"max_context_len": 0}, ValueError, "ContinuousBatcher: max_context_len must be an int >= 1, got 0"),
    ({"max_context_len": -3}, ValueError, "ContinuousBatcher: max_context_len must be an int >= 1, got -3"),
    ({"max_context_len": 8.5}, TypeError, "ContinuousBatcher: max_context_len must be an int >= 1, got 8.5"),
    ({"eos_token_id": "2"}, TypeError, "ContinuousBatcher: eos_token_id is '2' (str); token ids must be integers"),
    ({"eos_token_id": [1, 2.0]}, TypeError,
     "ContinuousBatcher: eos_token_id[1] is 2.0 (float); token ids must be integers"),
    ({"kv_cache_bytes": 2.5}, TypeError, "ContinuousBatcher: kv_cache_bytes must be an int >= 1, got 2.5"),
    ({"seed": 1.0}, TypeError, "ContinuousBatcher: seed must be an int >= 0, got 1.0"),
    ({"eos_token_id": 2.0}, TypeError, "ContinuousBatcher: eos_token_id is 2.0 (float); token ids must be integers"),
    ({"eos_token_id": 128}, ValueError,
     "ContinuousBatcher: eos_token_id is 128, outside the model's vocabulary (0 <= id < 128)"),
])
def test_the_batcher_refuses_bad_arguments_naming_them(model, kwargs, error, message):
    with pytest.raises(error) as info:
        ContinuousBatcher(model, backend="cpu", **{"max_bs": 2, **kwargs})
    assert str(info.value) == message


def test_unset_sizes_take_their_defaults(model):
    engine = ContinuousBatcher(model, max_bs=2, backend="cpu", capture_bs=[2])
    # the default KV budget (a share of free memory) holds more than the model's 64 positions
    assert (engine.cache.max_requests, engine.cache.max_context_len) == (2, model.config.max_position_embeddings)
    assert engine.cache.pool.size == 2 * 64 + 1 and engine.kv_budget.origin.startswith("0.25 of the ")
    assert engine.eos_token_ids == (model.generation_config.eos_token_id,) == (2,)
    assert engine.sample is None


# ------------------------------------------------------- re-entry from on_token


def test_step_from_an_on_token_callback_is_refused_and_events_stay_in_order(model):
    """A step's callbacks run after it committed: a step() inside one ran a whole step
    there, whose events reached the other requests before this step's (index 3 before 0)."""
    engine = make_engine(model)
    events, refused = [], []

    def reenter(event):
        events.append(event)
        try:
            engine.step()
        except RuntimeError as exc:
            refused.append(str(exc))

    reqs = [engine.add_request(prompt, n, on_token=reenter if i == 0 else events.append)
            for i, (prompt, n) in enumerate(SCHEDULE[0])]
    while not engine.done:
        engine.step()
    assert refused and set(refused) == {
        "ContinuousBatcher.step() called while a step's on_token callbacks run (from a callback, or another "
        "thread): call it after step() returns"}
    for req in reqs:
        assert [e.index for e in events if e.rid == req.rid] == list(range(len(req.output)))
    want = make_engine(model)
    plain = [want.add_request(prompt, n) for prompt, n in SCHEDULE[0]]
    while not want.done:
        want.step()
    assert [r.output for r in reqs] == [r.output for r in plain]
