"""The model's ``generation_config``: what changes generate's tokens is applied as generate
applies it, or refused at construction naming it (the batcher read only the sampling
settings, ``min_new_tokens`` and EOS, and dropped ``repetition_penalty`` and the rest
without a word)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import ContinuousBatcher, tiny_model  # noqa: E402
from graphslot.integrations.transformers.generation import REFUSED  # noqa: E402

transformers.logging.set_verbosity_error()

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1, 30]]
#: A value of each refused setting that is not neutral.
SET = {
    "repetition_penalty": 1.5, "encoder_repetition_penalty": 1.5, "no_repeat_ngram_size": 2,
    "encoder_no_repeat_ngram_size": 2, "bad_words_ids": [[112]], "sequence_bias": {(112,): -5.0},
    "forced_bos_token_id": 3, "forced_eos_token_id": 3, "exponential_decay_length_penalty": (2, 1.5),
    "remove_invalid_values": True, "guidance_scale": 1.5, "watermarking_config": {"bias": 2.0}, "typical_p": 0.9,
    "epsilon_cutoff": 0.01, "eta_cutoff": 0.01, "min_p": 0.1, "top_h": 0.5, "num_beams": 2, "num_beam_groups": 2,
    "diversity_penalty": 0.5, "penalty_alpha": 0.6, "dola_layers": "low", "num_return_sequences": 2,
    "stop_strings": ["x"], "max_time": 1.0, "token_healing": True,
}


def engine_for(model, **kwargs):
    return ContinuousBatcher(model, max_bs=2, max_context_len=24, backend="cpu", **kwargs)


def generate_alone(model, prompt, new):
    """generate with the model's generation_config (its EOS included), greedy."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_every_refused_setting_has_a_case():
    assert SET.keys() == REFUSED.keys()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_setting_the_batcher_does_not_apply_is_refused_naming_it(name):
    model = tiny_model("llama")
    setattr(model.generation_config, name, SET[name])
    with pytest.raises(ValueError, match=rf"^model.generation_config sets {name}=.*ContinuousBatcher does not apply "
                                         rf"it. Unset it .*model.generation_config.{name} = "):
        engine_for(model)
    setattr(model.generation_config, name, REFUSED[name][0][-1])  # its neutral value: served
    engine_for(model)


def test_repetition_penalty_changes_generate_s_tokens_so_it_cannot_be_dropped():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    plain = generate_alone(model, PROMPTS[1], 12)
    model.generation_config.repetition_penalty = 1.5
    assert generate_alone(model, PROMPTS[1], 12) != plain
    with pytest.raises(ValueError, match=r"repetition_penalty=1.5 \(scales down the scores of tokens already"):
        engine_for(model)


def test_a_request_cannot_carry_a_setting_the_batcher_does_not_apply():
    engine = engine_for(tiny_model("llama"))
    with pytest.raises(TypeError, match="repetition_penalty"):
        engine.add_request(PROMPTS[0], 4, repetition_penalty=1.2)


@pytest.mark.parametrize("settings", [
    dict(eos_token_id=7, min_length=9),  # 7 is the second greedy token of PROMPTS[1]: masked until 5 new tokens
    dict(eos_token_id=7, min_length=30),  # longer than prompt + max_new_tokens: EOS never drawn
    dict(eos_token_id=None, suppress_tokens=[96, 112, 64]),  # greedy tokens of both prompts
    dict(eos_token_id=None, begin_suppress_tokens=[96, 24]),  # the first greedy token of each
    dict(eos_token_id=7, renormalize_logits=True),  # a log_softmax: no token changes
    dict(eos_token_id=7, suppress_tokens=[112], begin_suppress_tokens=[24], min_length=7, min_new_tokens=3),
], ids=["min_length", "min_length-past-the-end", "suppress_tokens", "begin_suppress_tokens", "renormalize_logits",
        "together"])
@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # generate's, for min_length past the end
def test_an_applied_setting_gives_generate_s_tokens(settings):
    model = tiny_model("llama")
    plain = [generate_alone(model, prompt, 12) for prompt in PROMPTS]
    for name, value in settings.items():
        setattr(model.generation_config, name, value)
    want = [generate_alone(model, prompt, 12) for prompt in PROMPTS]
    if "renormalize_logits" not in settings:
        assert want != plain, "the setting changes generate's tokens"
    eos = {} if settings["eos_token_id"] else {"eos_token_id": ()}  # None: the engine would take the config's
    assert [req.output for req in engine_for(model, **eos).generate(PROMPTS, 12)] == want
    engine = engine_for(model, mix_prefill=True, **eos)
    first = engine.add_request(PROMPTS[0], 12)
    engine.step()
    second = engine.add_request(PROMPTS[1], 12)
    out = engine.step()
    assert second.rid in out.prefill_logits and out.decode_batch_size == 1  # it joined a running one: a mixed step
    while not engine.done:
        engine.step()
    assert [first.output, second.output] == want


def test_sampled_rows_never_draw_a_suppressed_token():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    model.generation_config.suppress_tokens = list(range(0, 128, 2))  # every even id
    model.generation_config.begin_suppress_tokens = [1, 3, 5]
    reqs = engine_for(model).generate(PROMPTS, 12, temperature=1.5, seed=4)
    tokens = [token for req in reqs for token in req.output]
    assert all(token % 2 for token in tokens) and all(req.output[0] not in (1, 3, 5) for req in reqs)
