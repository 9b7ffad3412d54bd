"""ContinuousBatcher stops as transformers' generate does: EOS ids (an int or a list, by
default the model's ``generation_config``), per-request stop tokens, ``max_new_tokens``
and ``min_new_tokens`` (EOS masked until reached); the EOS token stays in the output.

Each case runs several requests in one continuous batch (tiny random-weight Llama, CPU
tape backend) and compares every request's tokens with greedy ``model.generate`` on
that prompt alone. The EOS ids are tokens the greedy path of those prompts actually
hits (:data:`GREEDY`, checked by the first test), so the stops happen.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import ContinuousBatcher, tiny_model  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [64, 2, 31, 8], [11, 120], [100, 50, 25]]
#: The first 12 greedy tokens of each prompt without any EOS (generate's, and the engine's).
GREEDY = [[96, 64, 100, 40, 98, 39, 14, 49, 19, 95, 114, 124],
          [118, 120, 126, 112, 50, 59, 76, 20, 45, 79, 89, 123],
          [71, 46, 93, 107, 30, 78, 113, 92, 46, 90, 28, 6],
          [98, 50, 46, 50, 97, 101, 12, 51, 95, 12, 12, 12],
          [120, 23, 0, 14, 118, 14, 5, 99, 43, 47, 70, 14]]
N = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def generate(model, prompt, **kwargs):
    """generate's new tokens for ``prompt`` alone, greedy."""
    kwargs.setdefault("max_new_tokens", N)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def engine_run(model, engine_kwargs=None, **request_kwargs):
    engine = ContinuousBatcher(model, max_bs=3, max_context_len=24, backend="cpu", capture_bs=[3],
                               **(engine_kwargs or {}))
    reqs = engine.generate(PROMPTS, request_kwargs.pop("max_new_tokens", N), **request_kwargs)
    assert engine.done and engine.cache.available_slots == engine.cache.pool.size - 1
    return engine, reqs


def test_the_greedy_paths_the_cases_rely_on(model):
    assert [generate(model, p, eos_token_id=[]) for p in PROMPTS] == GREEDY
    _, reqs = engine_run(model, {"eos_token_id": ()})
    assert [r.output for r in reqs] == GREEDY
    assert {r.finish_reason for r in reqs} == {"length"}


@pytest.mark.parametrize("eos", [14, [12, 46], [50]], ids=["int", "list", "list-of-one"])
def test_eos_ends_each_request_as_generate_does_keeping_the_token(model, eos):
    _, reqs = engine_run(model, {"eos_token_id": eos})
    ids = [eos] if isinstance(eos, int) else eos
    for prompt, req, path in zip(PROMPTS, reqs, GREEDY):
        assert req.output == generate(model, prompt, eos_token_id=eos)
        stop = next((i for i, t in enumerate(path) if t in ids), None)
        assert req.output == path[: N if stop is None else stop + 1]
        assert req.finish_reason == ("length" if stop is None else "stop")
    assert sum(r.finish_reason == "stop" for r in reqs) >= 2


def test_the_default_eos_is_the_models_generation_config_then_its_config():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [12, 14]
    engine, reqs = engine_run(model)
    assert engine.eos_token_ids == (12, 14)
    assert [r.output for r in reqs] == [generate(model, p) for p in PROMPTS]  # generate's default is the same
    assert [len(r.output) for r in reqs] == [7, 12, 12, 7, 4]
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = 46
    assert ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu").eos_token_ids == (46,)
    model.config.eos_token_id = None
    assert ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu").eos_token_ids == ()


@pytest.mark.parametrize("min_new", [0, 4, 9])
def test_min_new_tokens_masks_eos_until_reached_as_generate_does(model, min_new):
    _, reqs = engine_run(model, {"eos_token_id": 14}, min_new_tokens=min_new)
    want = [generate(model, p, eos_token_id=14, min_new_tokens=min_new) for p in PROMPTS]
    assert [r.output for r in reqs] == want
    assert all(14 not in r.output[:min_new] for r in reqs)
    if min_new == 4:  # prompt 4 hits 14 at its 4th token unmasked: masked, its path changed
        assert want[4][:3] == GREEDY[4][:3] and want[4] != GREEDY[4][: len(want[4])]


def test_per_request_stop_tokens_and_eos_override_the_engines(model):
    engine = ContinuousBatcher(model, max_bs=4, max_context_len=24, backend="cpu", capture_bs=[4], eos_token_id=14)
    own = engine.add_request(PROMPTS[0], N, eos_token_id=())  # no EOS at all
    stops = engine.add_request(PROMPTS[1], N, stop_token_ids=[20])  # EOS 14 and 20
    other = engine.add_request(PROMPTS[4], N, eos_token_id=[5, 99])
    masked = engine.add_request(PROMPTS[2], N, stop_token_ids=[46], min_new_tokens=2)
    while not engine.done:
        engine.step()
    assert own.output == GREEDY[0] and own.finish_reason == "length"
    assert stops.output == GREEDY[1][:8] and stops.stop_token_ids == (14, 20)
    assert other.output == GREEDY[4][:7] and other.finish_reason == "stop"
    assert masked.output == generate(model, PROMPTS[2], eos_token_id=[14, 46], min_new_tokens=2)
    assert masked.output[1] != 46


def test_eos_as_the_first_token_ends_the_request_at_prefill(model):
    engine = ContinuousBatcher(model, max_bs=2, max_context_len=24, backend="cpu", capture_bs=[2])
    first = engine.add_request(PROMPTS[0], N, eos_token_id=GREEDY[0][0])
    other = engine.add_request(PROMPTS[1], N, eos_token_id=())
    out = engine.step()
    assert first.output == [GREEDY[0][0]] and first.finished and first.finish_reason == "stop"
    assert out.finished == [first.rid] and first.rid not in out.decode  # its decode row was in vain
    assert out.decode_batch_size == 2 and other.output == GREEDY[1][:2]
    assert [(e.rid, e.token, e.index, e.finish_reason) for e in out.events] == [
        (first.rid, GREEDY[0][0], 0, "stop"), (other.rid, GREEDY[1][0], 0, None), (other.rid, GREEDY[1][1], 1, None)]
    while not engine.done:
        engine.step()
    assert other.output == GREEDY[1] and engine.cache.available_slots == engine.cache.pool.size - 1


def test_a_one_token_request_is_not_decoded(model):
    engine = ContinuousBatcher(model, max_bs=2, max_context_len=24, backend="cpu", capture_bs=[2])
    req = engine.add_request(PROMPTS[3], 1)
    out = engine.step()
    assert req.output == GREEDY[3][:1] and req.finish_reason == "length"
    assert out.decode_batch_size == 0 and engine.done


@pytest.mark.parametrize("kwargs, error, message", [
    ({"eos_token_id": [1, 2.0]}, TypeError, "add_request: eos_token_id[1] is 2.0 (float); token ids must be integers"),
    ({"eos_token_id": "2"}, TypeError, "add_request: eos_token_id is '2' (str); token ids must be integers"),
    ({"eos_token_id": [3, 128]}, ValueError,
     "add_request: eos_token_id[1] is 128, outside the model's vocabulary (0 <= id < 128)"),
    ({"stop_token_ids": [-1]}, ValueError,
     "add_request: stop_token_ids[0] is -1, outside the model's vocabulary (0 <= id < 128)"),
    ({"stop_token_ids": 5}, TypeError, "add_request: stop_token_ids must be a sequence of token ids, got int"),
    ({"min_new_tokens": -1}, ValueError, "add_request: min_new_tokens must be an int >= 0, got -1"),
    ({"min_new_tokens": 1.5}, TypeError, "add_request: min_new_tokens must be an int >= 0, got 1.5"),
    ({"min_new_tokens": 5}, ValueError, "add_request: min_new_tokens=5 is more than max_new_tokens=4"),
], ids=["eos-float", "eos-str", "eos-out-of-vocab", "stop-negative", "stop-not-a-sequence", "min-negative",
        "min-float", "min-over-max"])
def test_stop_arguments_are_refused_naming_them(model, kwargs, error, message):
    engine = ContinuousBatcher(model, max_bs=1, max_context_len=16, backend="cpu")
    with pytest.raises(error) as info:
        engine.add_request([1, 2], 4, **kwargs)
    assert str(info.value) == message
    assert not engine.waiting and not engine.requests


def test_model_eos_ids_outside_the_vocabulary_are_dropped_as_generate_never_meets_them():
    model = tiny_model("phi3")  # Phi3Config's default eos_token_id is 32000, beyond the tiny vocabulary of 128
    assert model.generation_config.eos_token_id == 32000
    assert ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu").eos_token_ids == ()
    model.generation_config.eos_token_id = [-1, 7, 500]
    assert ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu").eos_token_ids == (7,)
    model.generation_config.eos_token_id = ["eos"]
    with pytest.raises(TypeError, match=r"^the model's eos_token_id \(generation_config, else config\)\[0\] is 'eos'"):
        ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu")
    with pytest.raises(ValueError, match=r"^ContinuousBatcher: eos_token_id is 500, outside the model's vocabulary"):
        ContinuousBatcher(model, max_bs=1, max_context_len=8, backend="cpu", eos_token_id=500)
