"""ContinuousBatcher's prefill computes logits only where they are used: the last prompt
position of each request (``logits_to_keep=1`` on left-padded rows), or the whole prompt
of a request that asked for its prompt logprobs; a model without ``logits_to_keep``
gets every position computed and the last ones taken, with the same results."""

from __future__ import annotations

import itertools
import random

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import (  # noqa: E402
    ContinuousBatcher,
    PerRequestHF,
    tiny_model,
)
from graphslot.integrations.transformers import batches  # noqa: E402
from graphslot.integrations.transformers.batches import prefill_groups  # noqa: E402
from graphslot.integrations.transformers.models import close  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [7, 7, 1], [64, 2, 31, 8], [11]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")  # a sliding window on one layer of two: the mask per layer type too


def make_engine(model, **kwargs):
    return ContinuousBatcher(model, max_bs=4, max_context_len=24, backend="cpu", capture_bs=[4], eos_token_id=(),
                             **kwargs)


def test_the_lm_head_sees_one_position_per_request(model):
    engine = make_engine(model)
    assert engine.last_logits_only
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        for prompt in PROMPTS:
            engine.add_request(prompt, 3)
        out = engine.step()
    finally:
        hook.remove()
    assert shapes[0] == (4, 1, model.config.hidden_size)  # the prefill: not 4 x 7 positions
    ref = PerRequestHF(model)
    for rid, logits in out.prefill_logits.items():
        assert close(logits, ref.prefill(rid, PROMPTS[rid]))


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no ``logits_to_keep``."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config, self.generation_config = inner, inner.config, inner.generation_config

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, position_ids, past_key_values, use_cache, attention_mask):
        return self.inner(input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values,
                          use_cache=use_cache, attention_mask=attention_mask)


def test_a_model_without_logits_to_keep_gives_the_same_tokens_and_logits(model):
    plain, fallback = make_engine(model), make_engine(NoLogitsToKeep(model).eval())
    assert not fallback.last_logits_only
    runs = []
    for engine in (plain, fallback):
        reqs = [engine.add_request(p, 5, prompt_logprobs=i % 2 == 0) for i, p in enumerate(PROMPTS)]
        first = engine.step()
        while not engine.done:
            engine.step()
        runs.append((first.prefill_logits, [r.output for r in reqs], [r.prompt_logprobs for r in reqs]))
    (logits_a, out_a, lp_a), (logits_b, out_b, lp_b) = runs
    assert out_a == out_b
    assert all(close(logits_a[rid], logits_b[rid]) for rid in logits_a)
    for a, b in zip(lp_a, lp_b):
        assert (a is None) == (b is None) and (a is None or a[1:] == pytest.approx(b[1:], abs=1e-5))


def test_prompt_logprobs_are_the_models_for_each_prompt_token(model):
    engine = make_engine(model)
    asks = [engine.add_request(p, 2, prompt_logprobs=True) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[2])]
    quiet = engine.add_request(PROMPTS[1], 2)
    while not engine.done:
        engine.step()
    for req in asks:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([req.prompt])).logits[0].float()
        want = logits[:-1].log_softmax(-1).gather(1, torch.tensor(req.prompt[1:]).unsqueeze(1)).squeeze(1)
        assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(req.prompt)
        assert req.prompt_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-5)
    assert asks[1].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    assert quiet.prompt_logprobs is None


def test_prefill_gathers_its_longest_prompt_not_max_context_len(model):
    engine = ContinuousBatcher(model, max_bs=4, max_context_len=200, backend="cpu", capture_bs=[4], eos_token_id=(),
                               lazy=True)
    gathered, write_and_gather = [], engine.cache.write_and_gather

    def record(layer, keys, values):
        out = write_and_gather(layer, keys, values)
        gathered.append((keys.shape[2], out[0].shape[2]))
        return out

    engine.cache.write_and_gather = record
    for prompt in PROMPTS:
        engine.add_request(prompt, 2)
    engine.step()
    layers = model.config.num_hidden_layers
    assert gathered[:layers] == [(7, 7)] * layers  # prefill: 7 tokens a row, 7 positions gathered, not 200
    assert set(gathered[layers:]) == {(1, 128)}  # the decode's capture: one token, the smallest context bucket


@pytest.mark.parametrize("family", ["bloom", "falcon-alibi"])
def test_the_2d_mask_route_prefills_right_padded_with_the_same_results(family):
    """Bloom and alibi Falcon need rows from column 0: right padding, every column's logits."""
    alibi = tiny_model(family)
    engine = ContinuousBatcher(alibi, max_bs=4, max_context_len=24, backend="cpu", capture_bs=[4], eos_token_id=())
    assert engine.cache.mask_route == "2d"
    reqs = [engine.add_request(p, 3, prompt_logprobs=i != 1) for i, p in enumerate(PROMPTS)]
    first = engine.step()
    while not engine.done:
        engine.step()
    ref = PerRequestHF(alibi)
    for req in reqs:
        logits = ref.prefill(req.rid, req.prompt)
        assert close(first.prefill_logits[req.rid], logits)
        with torch.no_grad():
            every = alibi(input_ids=torch.tensor([req.prompt])).logits[0].float()
        want = every[:-1].log_softmax(-1).gather(1, torch.tensor(req.prompt[1:]).unsqueeze(1)).squeeze(1)
        if req.rid != 1:
            assert req.prompt_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-4)
        ids = torch.tensor([req.prompt])
        assert req.output == alibi.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                            do_sample=False, eos_token_id=None,
                                            pad_token_id=0)[0, len(req.prompt):].tolist()



def test_prefill_groups_cut_where_padding_costs_more_than_a_forward():
    assert prefill_groups([10, 60, 12, 64, 30], 64) == [[0, 2], [4, 1, 3]]  # 2 forwards: 64 + 24 + 64 + 192
    assert prefill_groups([10, 60, 12, 64, 30], 1000) == [[0, 2, 4, 1, 3]]  # a costly forward: one, padded
    assert prefill_groups([5], 64) == [[0]] and prefill_groups([3, 3, 3], 0) == [[0, 1, 2]]
    rng = random.Random(0)
    for _ in range(200):  # the fewest padded positions plus forwards, against every cut of the sorted lengths
        lengths, forward = [rng.randint(1, 80) for _ in range(rng.randint(1, 7))], rng.choice([0, 16, 64, 200])
        order = sorted(range(len(lengths)), key=lengths.__getitem__)

        def cost(groups):
            return sum(forward + len(g) * max(lengths[i] for i in g) for g in groups)

        best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (len(order),))])
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        groups = prefill_groups(lengths, forward)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and cost(groups) == best


def test_prefill_in_groups_gives_what_one_forward_gives(model, monkeypatch):
    prompts = [[3] * 20, [5, 6], [7] * 17, [9, 10, 11], [12] * 19]
    runs = []
    for forward_tokens in (10**6, 0):  # one padded forward; then one forward per length
        monkeypatch.setattr(batches, "FORWARD_TOKENS", {"cpu": forward_tokens})
        engine = ContinuousBatcher(model, max_bs=5, max_context_len=32, backend="cpu", capture_bs=[5],
                                   eos_token_id=())
        widths = []
        hook = model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[0]))
        try:
            reqs = [engine.add_request(p, 4, prompt_logprobs=i % 2 == 0) for i, p in enumerate(prompts)]
            first = engine.step()
        finally:
            hook.remove()
        while not engine.done:
            engine.step()
        runs.append((widths, first.prefill_logits, [r.output for r in reqs], [r.prompt_logprobs for r in reqs]))
    (one, logits_a, out_a, lp_a), (grouped, logits_b, out_b, lp_b) = runs
    assert one == [5] and grouped == [1, 1, 1, 1, 1]  # rows per prefill forward (the decode replays a graph)
    assert out_a == out_b and all(close(logits_a[rid], logits_b[rid]) for rid in logits_a)
    for a, b in zip(lp_a, lp_b):
        assert (a is None) == (b is None) and (a is None or a[1:] == pytest.approx(b[1:], abs=1e-5))
