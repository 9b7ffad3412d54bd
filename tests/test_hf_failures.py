"""ContinuousBatcher fails early, naming what is wrong, and a request that fails does not
wedge the engine.

* A model that looks its positions up in a table (GPT-2, OPT: 64 positions in the tiny
  configs) took ``max_context_len=104`` and a 69-token prompt, then died in the step
  with a bare ``IndexError`` from the embedding, at every later ``step()`` too: now the
  construction refuses it, naming both numbers, and a request longer than the context
  is refused when it is added, naming it.
* A step that fails because of one request drops that request (``finish_reason``
  ``"error"``, its stream raises :class:`RequestFailed`) and serves the others; a failure
  no request alone explains still rolls the step back and raises.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from graphslot.integrations.transformers import ContinuousBatcher, RequestFailed, tiny_model  # noqa: E402

transformers.logging.set_verbosity_error()

POISON = 127  # a prompt holding this token fails its prefill (see poison)
GOOD = [[5, 17, 3, 99, 42], [7, 7, 1, 30], [64, 2, 31, 8, 11, 9]]
BAD = [4, POISON, 9]


@pytest.mark.parametrize("family, model_class", [("gpt2", "GPT2LMHeadModel"), ("opt", "OPTForCausalLM")])
def test_a_context_past_the_position_table_is_refused_at_construction(family, model_class):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=rf"^{model_class}: max_context_len=104 is more than the model's 64 positions "
                                         r"\(config.max_position_embeddings=64\): its position table ends there"):
        ContinuousBatcher(model, max_bs=2, max_context_len=104, backend="cpu")
    engine = ContinuousBatcher(model, max_bs=2, backend="cpu", eos_token_id=())
    assert engine.cache.max_context_len == 64  # the default stops at the table too
    with pytest.raises(ValueError, match=r"^add_request: a request of 69 prompt tokens and 4 new tokens needs 72 "
                                         r"cache positions, more than max_context_len=64"):
        engine.add_request(list(range(1, 70)), 4)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: add_request: a request of 69 prompt tokens"):
        engine.generate([[1, 2, 3], list(range(1, 70))], 4)
    assert engine.done  # the first prompt was aborted with the refusal
    assert len(engine.generate([list(range(1, 60))], 6)[0].output) == 6  # up to the table's end


def poison(model):
    """Make every prefill forward holding POISON raise (a request the model cannot run).
    Decode forwards (one token per row) are left alone: graphs replay them anyway."""
    def hook(module, args):
        ids = args[0]
        if ids.shape[-1] > 1 and bool((ids == POISON).any()):
            raise ValueError("poisoned prompt")

    return model.get_input_embeddings().register_forward_pre_hook(hook)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model):
    return ContinuousBatcher(model, max_bs=4, max_context_len=32, backend="cpu", capture_bs=[1, 2, 4],
                             eos_token_id=(), mix_prefill=False)


@pytest.fixture(scope="module")
def alone(model):
    """The good requests' tokens, without the bad one."""
    return [req.output for req in make_engine(model).generate(GOOD, 8)]


def test_a_request_that_fails_is_dropped_and_the_others_are_served(model, alone):
    engine = make_engine(model)
    handle = poison(model)
    try:
        good = [engine.add_request(prompt, 8) for prompt in GOOD[:2]]
        engine.step()
        engine.step()
        bad = engine.add_request(BAD, 8)
        good.append(engine.add_request(GOOD[2], 8))
        out = engine.step()  # its prefill fails: found, dropped, the step computed again without it
        assert out.failed == [bad.rid] and bad.rid not in out.prefill_logits
        assert bad.finished and bad.finish_reason == "error" and str(bad.error) == "poisoned prompt"
        assert sorted(out.prefill_logits) == [good[2].rid] and out.decode_batch_size == 3
        while not engine.done:
            assert engine.step().failed == []
    finally:
        handle.remove()
    assert [req.output for req in good] == alone
    assert bad.output == [] and engine.cache.available_requests == 4
    assert engine.cache.available_slots == engine.cache.num_slots - 1  # every slot went back


def test_the_failed_request_s_stream_raises_and_the_others_finish(model, alone):
    engine = make_engine(model)
    handle = poison(model)
    try:
        events = []
        with pytest.raises(RequestFailed, match=r"^request 1 failed and was dropped: a step failed because of it "
                                                r"alone \(ValueError: poisoned prompt\)$") as info:
            for event in engine.stream([GOOD[0], BAD, GOOD[1]], 8):
                events.append(event)
        assert isinstance(info.value.__cause__, ValueError) and info.value.rid == 1
        assert {event.rid for event in events} == {0, 2}  # that step's tokens of the others came first
        assert engine.done  # closing the stream aborted the others
        with pytest.raises(RequestFailed, match=r"^request 4 failed"):
            engine.generate([GOOD[0], BAD, GOOD[1], GOOD[2]], 8)
    finally:
        handle.remove()
    assert [engine.requests[rid].output for rid in (3, 5, 6)] == alone


def test_a_failure_no_request_alone_explains_still_rolls_back_and_raises(model, alone):
    engine = make_engine(model)
    handle = poison(model)
    try:
        bad = engine.add_request(BAD, 8)
        for _ in range(2):  # alone, it cannot be told from a failure of the engine: the step raises
            with pytest.raises(ValueError, match="^poisoned prompt$"):
                engine.step()
            assert not bad.finished and list(engine.waiting) == [bad]
        good = [engine.add_request(prompt, 8) for prompt in GOOD]
        assert engine.step().failed == [bad.rid]  # beside others it is found, and they are served
        while not engine.done:
            engine.step()
    finally:
        handle.remove()
    assert [req.output for req in good] == alone

    def broken(logits):  # every request fails alone: not one request's fault
        raise RuntimeError("broken sampler")

    engine = make_engine(model)
    reqs = [engine.add_request(prompt, 8) for prompt in GOOD]
    engine.sample = broken
    with pytest.raises(RuntimeError, match="^broken sampler$"):
        engine.step()
    assert not any(req.finished for req in reqs) and len(engine.waiting) == 3
    assert engine.cache.available_slots == engine.cache.num_slots - 1
