"""A request's tokens do not depend on its neighbours, whatever the rope type.

transformers' ``longrope`` picks its short or long factors from the batch's longest
sequence, so an 8-token request decoded beside a 60-token one got the long factors and
other tokens than ``generate`` gives it alone. graphslot chooses per row
(:mod:`graphslot.integrations.transformers.rope`), inside the captured graphs; the rope
types computed once (``linear``, ``yarn``, ``llama3``, ``proportional``, the default)
need nothing, and ``dynamic`` is refused at construction. Every case: a short request
beside a long neighbour, each equal to ``model.generate`` of it alone (greedy).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import (  # noqa: E402
    ContinuousBatcher, HFDecodeAdapter, HFPrefillAdapter, PagedCache, tiny_model,
)

transformers.logging.set_verbosity_error()

ORIGINAL, POSITIONS = 32, 128
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.5 * i for i in range(8)])
SHORT = [(5 * j) % 120 + 2 for j in range(8)]
LONG = [(11 * j) % 120 + 3 for j in range(60)]


def longrope_model(family):
    if family == "phi3":  # Phi-3 names the original length in its config
        return tiny_model("phi3", max_position_embeddings=POSITIONS, original_max_position_embeddings=ORIGINAL,
                          rope_parameters=dict(LONGROPE))
    return tiny_model(family, max_position_embeddings=POSITIONS,
                      rope_parameters=dict(LONGROPE, original_max_position_embeddings=ORIGINAL))


def generate_alone(model, prompt, new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def serve_together(model, requests, **kwargs):
    engine = ContinuousBatcher(model, max_bs=len(requests), max_context_len=POSITIONS, backend="cpu",
                               eos_token_id=(), **kwargs)
    reqs = [engine.add_request(prompt, new) for prompt, new in requests]
    graphs = []
    while not engine.done:
        graphs.append(engine.step().decode_graph)
    assert all(graphs[1:]), "the decode steps replay graphs"
    return [req.output for req in reqs]


@pytest.mark.parametrize("family", ["phi3", "llama"])
def test_a_longrope_request_beside_a_long_neighbour_gets_what_generate_gives_it_alone(family):
    model = longrope_model(family)
    requests = [(SHORT, 10), (LONG, 10)]
    want = [generate_alone(model, prompt, new) for prompt, new in requests]
    assert serve_together(model, requests) == want
    assert serve_together(model, requests, mix_prefill=True) == want  # a longrope model prefills apart


def test_a_llama_longrope_request_passing_the_switch_keeps_its_short_keys_as_generate_does():
    """Llama's generate changes factors at the switch and keeps the keys it cached: so does the engine."""
    model = longrope_model("llama")
    requests = [([(3 * j) % 120 + 1 for j in range(28)], 12), (SHORT, 6), (LONG, 4)]
    want = [generate_alone(model, prompt, new) for prompt, new in requests]
    assert serve_together(model, requests) == want


def test_a_phi3_request_passing_the_switch_is_refused_naming_it():
    """Phi-3's generate recomputes the whole sequence there, which a paged cache does not."""
    engine = ContinuousBatcher(longrope_model("phi3"), max_bs=2, max_context_len=POSITIONS, backend="cpu")
    with pytest.raises(ValueError, match=r"^add_request: a request of 28 prompt tokens and 12 new tokens passes the "
                                         r"longrope switch at original_max_position_embeddings=32: there "
                                         r"Phi3ForCausalLM.generate recomputes"):
        engine.add_request(list(range(1, 29)), 12)
    engine.add_request(list(range(1, 29)), 5)  # decodes up to position 31: short factors throughout
    engine.add_request(list(range(1, 34)), 12)  # long factors from its prompt on


@pytest.mark.parametrize("rope", [
    dict(rope_type="default"),
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=ORIGINAL),
    dict(rope_type="proportional", factor=2.0),
], ids=lambda rope: rope["rope_type"])
def test_a_rope_computed_once_needs_nothing_per_row(rope):
    model = tiny_model("llama", max_position_embeddings=POSITIONS, rope_parameters=dict(rope, rope_theta=10000.0))
    requests = [(SHORT, 10), (LONG, 10)]
    assert serve_together(model, requests) == [generate_alone(model, prompt, new) for prompt, new in requests]


def test_dynamic_rope_is_refused_at_construction_naming_it():
    """Its frequencies are module state updated after a host read ('host sync during graph
    capture', or every lazy step failing, before)."""
    model = tiny_model("llama", max_position_embeddings=POSITIONS,
                       rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    message = r"^LlamaForCausalLM: rope_type 'dynamic' \(config.rope_parameters\) is not supported"
    with pytest.raises(ValueError, match=message):
        ContinuousBatcher(model, max_bs=2, max_context_len=POSITIONS, backend="cpu", lazy=True)
    cache = PagedCache(model.config, max_requests=1, max_context_len=8)
    with pytest.raises(ValueError, match=message):
        HFDecodeAdapter(model, cache)


def test_the_prefill_adapter_refuses_longrope_naming_it():
    """It packs every request's tokens in one row, so they would share one choice."""
    model = longrope_model("llama")
    cache = PagedCache(model.config, max_requests=1, max_context_len=8)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: rope_type 'longrope' depends on each sequence's "
                                         r"length"):
        HFPrefillAdapter(model, cache)


def test_the_model_runs_transformers_own_rope_outside_the_engine():
    """The per-row choice is bound on the rotary module for graphslot's forwards only."""
    model = longrope_model("llama")
    ContinuousBatcher(model, max_bs=2, max_context_len=POSITIONS, backend="cpu").generate([SHORT], 2)
    assert "forward" not in vars(model.model.rotary_emb)
