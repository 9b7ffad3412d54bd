"""The device sampler and per-request sampling: greedy rows are exactly argmax, sampled
rows follow generate's warpers in distribution, a seeded request draws the same tokens
whatever else is in the batch (and after a rolled-back step), logprobs are
``log_softmax`` of the model's logits, streaming hands out what the outputs hold, and
every sampling parameter is checked, the refusal naming it.

The distribution checks draw many tokens from one fixed row of logits (one row per
draw, each with its own seed) and compare the frequencies with the probabilities of
transformers' own ``TemperatureLogitsWarper``/``TopKLogitsWarper``/``TopPLogitsWarper``
followed by softmax, within loose bounds (5 standard deviations): fast, and independent
of generate's random stream.
"""

from __future__ import annotations

import itertools
import math

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import GenerationConfig, LogitsProcessorList  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from graphslot.integrations.transformers import ContinuousBatcher, tiny_model  # noqa: E402
from graphslot.integrations.transformers.sampling import (  # noqa: E402
    GENERATE_DEFAULTS,
    MIN_TEMPERATURE,
    Row,
    Sampler,
    SamplingParams,
    mix32,
    mix32_reference,
    row_key,
)

GREEDY = SamplingParams()


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(do_sample=True, **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0, **kwargs})


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, **kwargs):
    kwargs = {"max_bs": 4, "max_context_len": 32, "backend": "cpu", "capture_bs": [4], "eos_token_id": (), **kwargs}
    return ContinuousBatcher(model, **kwargs)


# ---------------------------------------------------------------- the sampler alone


def test_generates_defaults_are_transformers_own():
    defaults = GenerationConfig._get_default_generation_params()
    assert GENERATE_DEFAULTS == {name: defaults[name] for name in GENERATE_DEFAULTS}


def test_the_hash_wraps_like_its_32_bit_specification():
    values = [0, 1, 2, 0x7FFF, 0x12345678, 2**31 - 1, 2**31, 2**31 + 1, 0xDEADBEEF, 2**32 - 1]
    signed = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    assert [v % 2**32 for v in mix32(signed).tolist()] == [mix32_reference(v) for v in values]
    assert len({row_key(7, i) for i in range(1000)} | {row_key(8, i) for i in range(1000)}) == 2000


def test_greedy_rows_are_exactly_argmax_ties_included():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    logits[1, [3, 9]] = logits[1].max() + 1  # a tie: argmax's first
    logits[4] = 0.0  # all equal
    rows = [Row(GREEDY, 0), Row(GREEDY, 1), Row(sampled(temperature=0.0), 2), Row(SamplingParams(temperature=5.0), 3),
            Row(GREEDY, 4), Row(sampled(top_k=1, seed=9), 5)]
    got = Sampler()(logits, rows).tokens
    assert torch.equal(got, logits.argmax(-1)) and got[1] == 3 and got[4] == 0


def test_top_k_1_and_a_vanishing_temperature_are_greedy():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(1)) * 3
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # no near-ties
    sampler = Sampler()
    for params in ({"top_k": 1}, {"temperature": 1e-5}, {"top_k": 1, "top_p": 0.5, "temperature": 2.0},
                   {"top_p": 1e-6}):
        rows = [Row(sampled(seed=s, **params), i) for i, s in enumerate(range(64))]
        assert torch.equal(sampler(logits, rows).tokens, logits.argmax(-1)), params


def test_the_smallest_temperature_draws_the_argmax_whatever_the_logits_size_and_dtype():
    """At ``MIN_TEMPERATURE`` the scaled scores of all but the top token overflow to -inf,
    never the top's to +inf (which made every large logit a tie: the lowest ids won).
    bf16 logits, and the same values as float32 and float64, draw the same tokens."""
    sampler = Sampler()
    gen = torch.Generator().manual_seed(5)
    base = torch.stack([(torch.randperm(100, generator=gen) - 50) / 10 for _ in range(16)])
    for scale in (1.0, 1e4, 1e30):
        logits = (base * scale).bfloat16()
        top2 = logits.float().topk(2).values
        assert (top2[:, 0] > top2[:, 1]).all()  # no ties
        want = logits.float().argmax(-1)
        for temperature in (MIN_TEMPERATURE, 1e-37, 1e-30, 0.7):
            rows = [Row(sampled(seed=s, temperature=temperature, top_p=0.9 if s % 2 else 1.0), 3) for s in range(16)]
            got = [sampler(logits.to(dtype), rows).tokens for dtype in (torch.bfloat16, torch.float32, torch.float64)]
            assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]), (scale, temperature)
            if temperature < 1e-4:
                assert torch.equal(got[0], want), (scale, temperature)


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits.view(1, -1).clone()).softmax(-1).view(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.9), (1.0, 50, 1.0),
], ids=["plain", "temperature", "top-k", "top-p", "all-three", "generate's-default-top-k"])
def test_draws_follow_generates_warpers_in_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.6, 0.5, 0.1, 0.0, -0.3, -0.7, -1.0, -2.0, -3.0, 1.1, 0.9, 0.2])
    want = hf_probs(logits, temperature, top_k, top_p)
    n = 20000
    rows = [Row(sampled(temperature=temperature, top_k=top_k, top_p=top_p, seed=s % 97), s // 97) for s in range(n)]
    tokens = Sampler()(logits.expand(n, -1), rows).tokens
    freq = torch.bincount(tokens, minlength=logits.numel()).double() / n
    assert (freq[want == 0] == 0).all()  # a removed token is never drawn
    bound = 5 * (want * (1 - want) / n).sqrt() + 1e-3
    assert ((freq - want).abs() <= bound).all(), (freq, want)


def test_a_row_draws_the_same_whatever_its_neighbours_and_place():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=gen)
    rows = [Row(sampled(seed=100 + i, temperature=1.3, top_p=0.95 if i % 2 else 1.0, top_k=40 if i % 3 else 0),
                index=i * 5) for i in range(8)]
    sampler = Sampler()
    alone = [sampler(logits[i:i + 1], [rows[i]]).tokens.item() for i in range(8)]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    mixed = sampler(logits[order], [rows[i] for i in order]).tokens.tolist()
    assert [mixed[order.index(i)] for i in range(8)] == alone
    with_greedy = sampler(torch.cat([logits[:1], logits[3:4]]), [Row(GREEDY, 0), rows[3]]).tokens.tolist()
    assert with_greedy[1] == alone[3]
    assert len(set(alone)) > 4  # they do sample


READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def test_the_sampler_reads_nothing_back_from_the_device(monkeypatch):
    """Every row's parameters go to the device as small tensors; the picks stay there."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    rows = [Row(GREEDY, 0), Row(sampled(seed=1, temperature=0.7, top_k=5, top_p=0.9), 2, blocked=(4,), logprobs=3),
            Row(sampled(seed=2, top_p=0.8), 0, logprobs=0), Row(sampled(seed=3, temperature=1.3, top_k=20), 1),
            Row(GREEDY, 4, blocked=(int(logits[4].argmax()),))]
    want = Sampler()(logits, rows)

    def refuse(self, *args, **kwargs):
        raise AssertionError("the sampler read the device")

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, refuse)
        got = Sampler()(logits, rows)
    assert torch.equal(got.tokens, want.tokens) and got.top_ids.shape == (5, 3)
    assert got.tokens[4] != logits[4].argmax()  # the blocked argmax was not picked


def test_a_step_reads_the_device_once_whatever_its_rows_ask(model, monkeypatch):
    from graphslot.integrations.transformers import computing

    engine, reads = make_engine(model), []
    real = computing.to_host
    monkeypatch.setattr(computing, "to_host", lambda tensors: reads.append(len(tensors)) or real(tensors))
    engine.add_request(PROMPTS[0], 6)
    engine.add_request(PROMPTS[1], 6, temperature=0.8, top_k=7, logprobs=True)
    engine.add_request(PROMPTS[2], 6, top_p=0.9, seed=4, top_logprobs=2, prompt_logprobs=True)
    engine.add_request(PROMPTS[3], 6, min_new_tokens=3, eos_token_id=[1, 2])
    steps = 0
    while not engine.done:
        engine.step()
        steps += 1
    assert steps >= 5 and len(reads) == steps  # one read per step, with every row's tokens and logprobs in it


# ---------------------------------------------------------------- through the engine


PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [64, 2, 31, 8], [11, 120], [100, 50, 25], [9, 9, 9, 9]]


def test_greedy_requests_match_generate_and_sampled_ones_do_sample(model):
    engine = make_engine(model)
    greedy = engine.add_request(PROMPTS[0], 10)
    hot = [engine.add_request(PROMPTS[0], 10, temperature=1.5, seed=s) for s in range(3)]
    while not engine.done:
        engine.step()
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False, eos_token_id=[],
                              pad_token_id=0)[0, 5:].tolist()
    assert greedy.output == want
    assert len({tuple(r.output) for r in hot} | {tuple(want)}) == 4


def run_schedule(model, schedule, steps=12, **engine_kwargs):
    """``schedule``: step -> [(name, prompt, kwargs)]; the outputs by name."""
    engine = make_engine(model, **engine_kwargs)
    reqs = {}
    for k in range(steps):
        for name, prompt, kwargs in schedule.get(k, ()):
            reqs[name] = engine.add_request(prompt, kwargs.pop("n", 8), **kwargs)
        engine.step()
    assert engine.done
    return {name: r.output for name, r in reqs.items()}


def test_a_seeded_request_draws_the_same_alone_or_with_others_joining_and_leaving(model):
    me = ("me", PROMPTS[2], {"temperature": 1.2, "top_p": 0.9, "seed": 1234, "n": 9})
    alone = run_schedule(model, {0: [dict_copy(me)]})["me"]
    busy = run_schedule(model, {
        0: [("a", PROMPTS[0], {"n": 3, "temperature": 0.9, "seed": 1}), ("b", PROMPTS[1], {"n": 6})],
        1: [dict_copy(me), ("c", PROMPTS[3], {"n": 2, "top_k": 5, "seed": 2})],
        3: [("d", PROMPTS[4], {"n": 8, "temperature": 2.0, "seed": 3}), ("e", PROMPTS[5], {"n": 4})],
    }, max_bs=4)
    assert busy["me"] == alone
    unseeded = run_schedule(model, {0: [("me", PROMPTS[2], {"temperature": 1.2, "top_p": 0.9, "n": 9})]}, seed=5)
    assert unseeded["me"] == run_schedule(model, {0: [("me", PROMPTS[2], {"temperature": 1.2, "top_p": 0.9,
                                                                          "n": 9})]}, seed=5)["me"]
    other = run_schedule(model, {0: [("me", PROMPTS[2], {"seed": 4321, "temperature": 1.2, "top_p": 0.9, "n": 9})]})
    assert other["me"] != alone


def dict_copy(entry):
    name, prompt, kwargs = entry
    return name, prompt, dict(kwargs)


def test_a_failed_sampling_step_draws_the_same_when_retried(model):
    class Boom(Exception):
        pass

    def run(fail_at):
        engine = make_engine(model)
        reqs = [engine.add_request(p, 6, temperature=1.3, seed=i) for i, p in enumerate(PROMPTS[:3])]
        real, calls = engine.sampler, itertools.count()

        def flaky(logits, rows):
            choice = real(logits, rows)
            if next(calls) == fail_at:
                raise Boom
            return choice

        engine.sampler = flaky
        while not engine.done:
            try:
                engine.step()
            except Boom:
                pass
        return [r.output for r in reqs]

    assert run(fail_at=1) == run(fail_at=3) == run(fail_at=-1)


def test_logprobs_are_log_softmax_of_the_models_logits(model):
    engine = make_engine(model)
    greedy = engine.add_request(PROMPTS[0], 5, logprobs=True)
    hot = engine.add_request(PROMPTS[1], 5, temperature=1.4, top_k=20, seed=3, top_logprobs=4)
    plain = engine.add_request(PROMPTS[2], 5)
    rows = {greedy.rid: [], hot.rid: []}
    while not engine.done:
        out = engine.step()
        for rid, logits in out.prefill_logits.items():
            rows.get(rid, []).append(logits)
        for rid, (_, logits) in out.decode.items():
            rows.get(rid, []).append(logits)
    for req in (greedy, hot):
        assert len(req.logprobs) == len(req.output) == len(rows[req.rid]) == 5
        for token, lp, logits in zip(req.output, req.logprobs, rows[req.rid]):
            assert lp == pytest.approx(logits.float().log_softmax(-1)[token].item(), abs=1e-5)
    assert greedy.logprobs == pytest.approx([lr.log_softmax(-1).max().item() for lr in rows[greedy.rid]], abs=1e-5)
    assert greedy.top_logprobs is None and plain.logprobs is None and plain.top_logprobs is None
    for top, logits in zip(hot.top_logprobs, rows[hot.rid]):
        values, ids = logits.log_softmax(-1).topk(4)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)


def test_streaming_hands_out_what_the_outputs_hold(model):
    engine = make_engine(model)
    seen = []
    called = engine.add_request(PROMPTS[3], 6, temperature=0.8, seed=1, logprobs=True, on_token=seen.append)
    events = list(engine.stream(PROMPTS[:3], 5, top_k=10, seed=2))
    assert not called.finished  # it wants one token more than the streamed ones
    while not engine.done:
        engine.step()
    by_rid = {}
    for event in events:
        by_rid.setdefault(event.rid, []).append(event)
    assert len(by_rid) == 3
    for rid, evs in by_rid.items():
        req = engine.requests[rid]
        assert [e.token for e in evs] == req.output and [e.index for e in evs] == list(range(5))
        assert [e.finish_reason for e in evs] == [None] * 4 + ["length"] and evs[-1].finished
    assert [e.token for e in seen] == called.output and [e.logprob for e in seen] == called.logprobs
    assert [e.rid for e in seen] == [called.rid] * 6


def test_closing_a_stream_early_aborts_its_requests(model):
    engine = make_engine(model)
    stream = engine.stream(PROMPTS[:2], 8)
    first = next(stream)
    stream.close()
    assert engine.done and first.index == 0
    assert {r.finish_reason for r in engine.requests.values()} == {"abort"}
    assert engine.cache.available_slots == engine.cache.pool.size - 1


def round_robin(streams):
    """Each stream's events, taking one from each in turn (as a server serves two clients)."""
    got, live = [[] for _ in streams], list(enumerate(streams))
    while live:
        for i, stream in list(live):
            try:
                got[i].append(next(stream))
            except StopIteration:
                live.remove((i, stream))
    return got


def test_interleaved_streams_each_deliver_every_token_of_their_own_requests(model):
    """Whoever steps the engine, a stream hands out all its requests' tokens (those of a
    step another stream drove wait in its queue), in order, and nothing else."""
    want = [[r.output for r in make_engine(model).generate(prompts, 8, **kw)]
            for prompts, kw in ((PROMPTS[:2], {}), (PROMPTS[2:4], {"temperature": 0.9, "seed": 7}))]
    engine, stepped = make_engine(model), []
    streams = [engine.stream(PROMPTS[:2], 8, on_token=stepped.append),
               engine.stream(PROMPTS[2:4], 8, temperature=0.9, seed=7, top_logprobs=2, on_token=stepped.append)]
    got = round_robin(streams)
    assert engine.done and {r.finish_reason for r in engine.requests.values()} == {"length"}
    for events, outputs in zip(got, want):
        rids = sorted({e.rid for e in events})
        assert len(rids) == 2 and len(events) == 16
        for rid, output in zip(rids, outputs):
            mine = [e for e in events if e.rid == rid]
            assert [e.token for e in mine] == output == engine.requests[rid].output
            assert [e.index for e in mine] == list(range(8)) and mine[-1].finish_reason == "length"
            assert mine == [e for e in stepped if e.rid == rid]  # the events the steps handed out, logprobs and all


def test_a_stream_closed_or_dropped_before_its_first_token_aborts_its_requests(model):
    engine = make_engine(model)
    full = (engine.cache.available_slots, engine.cache.available_requests)
    stream = engine.stream(PROMPTS[:2], 8)
    stream.close()
    assert engine.done and [(r.finish_reason, r.output) for r in engine.requests.values()] == [("abort", [])] * 2
    dropped = engine.stream(PROMPTS[2:4], 8)
    del dropped
    assert engine.done and [r.finish_reason for r in engine.requests.values()] == ["abort"] * 4
    kept = engine.stream(PROMPTS[:1], 3)
    assert [e.index for e in kept] == [0, 1, 2]  # the aborted ones were never decoded
    assert engine.step().events == [] and (engine.cache.available_slots, engine.cache.available_requests) == full


def test_a_raising_callback_does_not_keep_the_others_from_theirs(model):
    engine = make_engine(model)
    got = []

    def bad(event):
        raise RuntimeError("client went away")

    engine.add_request(PROMPTS[0], 3, on_token=bad)
    ok = engine.add_request(PROMPTS[1], 3, on_token=got.append)
    with pytest.raises(RuntimeError, match="^client went away") as info:
        engine.step()
    # the bare error named neither the request nor the callback
    assert info.value.__notes__ == ["graphslot: raised by the on_token callback of request 0; the step was "
                                    "committed (its tokens are in the requests' outputs)"]
    assert [e.token for e in got] == ok.output and len(ok.output) == 2  # the step committed
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.done and [e.token for e in got] == ok.output


def test_a_custom_sample_still_works_and_refuses_per_request_sampling(model):
    engine = make_engine(model, sample=lambda scores: scores.argmin(-1))
    req = engine.add_request(PROMPTS[0], 4, logprobs=True)
    with pytest.raises(ValueError) as info:
        engine.add_request(PROMPTS[0], 4, temperature=0.5)
    assert str(info.value) == ("add_request: temperature is set, but this engine picks tokens with its sample= "
                               "function, which replaces per-request sampling: drop it, or build the engine without "
                               "sample=")
    logits = []
    while not engine.done:
        out = engine.step()
        logits += list(out.prefill_logits.values()) + [lg for _, lg in out.decode.values()]
    assert req.output == [lg.argmin().item() for lg in logits]
    assert req.logprobs == pytest.approx([lg.log_softmax(-1).min().item() for lg in logits], abs=1e-5)


def test_the_models_generation_config_gives_the_defaults():
    model = tiny_model("llama")
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.5
    model.generation_config.top_p = 0.9
    engine = make_engine(model)
    assert engine.defaults == {"do_sample": True, "temperature": 0.5, "top_k": 50, "top_p": 0.9}
    req = engine.add_request(PROMPTS[0], 2)
    assert (req.sampling.do_sample, req.sampling.temperature, req.sampling.top_k, req.sampling.top_p) == (
        True, 0.5, 50, 0.9)
    assert not engine.add_request(PROMPTS[0], 2, do_sample=False).sampling.do_sample
    assert engine.add_request(PROMPTS[0], 2, top_k=0).sampling.top_k == 0
    model.generation_config.top_k = "many"
    with pytest.raises(TypeError, match=r"^model.generation_config: top_k must be an int >= 0 \(0: off\), got 'many'$"):
        make_engine(model)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"temperature": -0.5}, ValueError, "add_request: temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    ({"temperature": math.inf}, ValueError,
     "add_request: temperature must be a finite number >= 0 (0: greedy), got inf"),
    ({"temperature": "hot"}, TypeError, "add_request: temperature must be a finite number >= 0 (0: greedy), got 'hot'"),
    ({"temperature": True}, TypeError, "add_request: temperature must be a finite number >= 0 (0: greedy), got True"),
    ({"top_k": -1}, ValueError, "add_request: top_k must be an int >= 0 (0: off), got -1"),
    ({"top_k": 2.0}, TypeError, "add_request: top_k must be an int >= 0 (0: off), got 2.0"),
    ({"top_p": 0}, ValueError, "add_request: top_p must be a finite number in (0, 1] (1: off), got 0"),
    ({"top_p": 1.5}, ValueError, "add_request: top_p must be a finite number in (0, 1] (1: off), got 1.5"),
    ({"top_p": math.nan}, ValueError, "add_request: top_p must be a finite number in (0, 1] (1: off), got nan"),
    ({"seed": -1}, ValueError, "add_request: seed must be an int >= 0, got -1"),
    ({"seed": "7"}, TypeError, "add_request: seed must be an int >= 0, got '7'"),
    ({"do_sample": 1}, TypeError, "add_request: do_sample must be True or False or None, got 1"),
    ({"logprobs": "yes"}, TypeError, "add_request: logprobs must be True or False, got 'yes'"),
    ({"top_logprobs": -2}, ValueError, "add_request: top_logprobs must be an int >= 0, got -2"),
    ({"top_logprobs": 129}, ValueError, "add_request: top_logprobs=129 is more than the vocabulary (128)"),
    ({"prompt_logprobs": None}, TypeError, "add_request: prompt_logprobs must be True or False, got None"),
    ({"on_token": 3}, TypeError, "add_request: on_token must be callable (it gets each TokenEvent), got 3"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_sampling_arguments_are_refused_naming_them(model, kwargs, error, message):
    engine = make_engine(model)
    with pytest.raises(error) as info:
        engine.add_request([1, 2], 4, **kwargs)
    assert str(info.value) == message
    assert not engine.waiting and not engine.requests


TOO_COLD = "temperature must be 0 (greedy) or at least 1.1754943508222875e-38 (MIN_TEMPERATURE: float32's " \
           "smallest normal number; below it the logits divided by it overflow), got "


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-46, 5e-324, MIN_TEMPERATURE / 2, 1e-300,
                                         torch.tensor(1e-40, dtype=torch.float64)], ids=str)
def test_a_temperature_below_the_float32_minimum_is_refused_naming_it(model, temperature):
    engine = make_engine(model)
    with pytest.raises(ValueError) as info:
        engine.add_request([1, 2], 4, temperature=temperature)
    assert str(info.value) == f"add_request: {TOO_COLD}{temperature!r}"
    assert not engine.requests
    cold = tiny_model("llama")
    cold.generation_config.temperature = temperature
    with pytest.raises(ValueError) as info:
        make_engine(cold)
    assert str(info.value) == f"model.generation_config: {TOO_COLD}{temperature!r}"


def test_the_smallest_temperature_is_greedy_through_the_engine(model):
    engine = make_engine(model)
    cold = [engine.add_request(PROMPTS[0], 8, temperature=t, seed=s) for s, t in enumerate((MIN_TEMPERATURE, 1e-30))]
    greedy = engine.add_request(PROMPTS[0], 8)
    while not engine.done:
        engine.step()
    assert cold[0].output == cold[1].output == greedy.output
    assert engine.add_request(PROMPTS[0], 2, temperature=0).sampling.greedy


def test_a_refused_prompt_in_a_stream_queues_none(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: add_request: prompt\[0\] is 300, outside"):
        engine.stream([[1, 2], [300]], 3)
    assert engine.done and all(r.finish_reason == "abort" for r in engine.requests.values())
    with pytest.raises(ValueError, match=r"^ContinuousBatcher: seed must be an int >= 0, got -3$"):
        make_engine(model, seed=-3)
