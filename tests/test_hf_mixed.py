"""Mixed prefill steps (``ContinuousBatcher(mix_prefill=...)``, on by default on the CPU):
a step that admits requests while others run is one packed eager forward of the running
requests' tokens and the new prompts (the weights read once, not twice), and the new
requests decode from the next step. For every family that can pack: rows allclose to
transformers per request, tokens equal to the same schedule without mixing and to
``model.generate``, one eager forward per mixed step. A step that cannot mix (a request
wants its prompt logprobs, a mask too large) prefills apart; the 2-D mask route, MPT and a
model without ``logits_to_keep`` never mix; a mixed step that fails rolls back."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import (  # noqa: E402
    FAMILIES,
    ContinuousBatcher,
    PerRequestHF,
    batches,
    computing,
    tiny_model,
)
from graphslot.integrations.transformers.families import packs  # noqa: E402
from graphslot.integrations.transformers.models import close, max_abs_diff, tiny_config  # noqa: E402

transformers.logging.set_verbosity_error()

#: step -> requests arriving then (prompt length, new tokens): admissions while others run.
ARRIVALS = {0: [(5, 6)], 1: [(3, 9), (9, 4)], 3: [(12, 7)], 4: [(1, 5)], 6: [(7, 8), (2, 3)]}
PACKING = [name for name in FAMILIES if packs(tiny_config(name))]


def prompt(i, length):
    return [(7 * i + 3 * j) % 120 + 1 for j in range(length)]


def drive(model, **options):
    """Run ARRIVALS; per step its output and how many eager forwards it ran."""
    engine = ContinuousBatcher(model, max_bs=3, max_context_len=32, backend="cpu", eos_token_id=(), **options)
    forwards, steps, requests, step = [], [], [], 0
    hook = model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        while step in ARRIVALS or any(s > step for s in ARRIVALS) or not engine.done:
            for length, new in ARRIVALS.get(step, []):
                requests.append(engine.add_request(prompt(len(requests), length), new))
            before = len(forwards)
            steps.append((engine.step(), len(forwards) - before))
            step += 1
    finally:
        hook.remove()
    return engine, steps, requests


def test_packing_families_are_all_but_the_alibi_ones():
    assert set(FAMILIES) - set(PACKING) == {"bloom", "falcon-alibi", "mpt"}


@pytest.mark.parametrize("name", PACKING)
def test_mixed_steps_decode_like_transformers_and_generate(name):
    model = tiny_model(name)
    engine, steps, requests = drive(model)
    assert engine.mix_prefill
    mixed = [(out, n) for out, n in steps if out.prefill_logits and out.decode and not out.decode_graph]
    assert len(mixed) >= 3 and all(n == 1 for _, n in mixed)  # one forward: prefill and decode together
    for out, _ in mixed:  # the admitted requests draw their first token and wait for the next step to decode
        assert not set(out.prefill_logits) & set(out.decode)
    ref, worst = PerRequestHF(model), 0.0
    for out, _ in steps:
        rows = [(logits, ref.prefill(rid, engine.requests[rid].prompt)) for rid, logits in out.prefill_logits.items()]
        rows += [(logits, ref.decode(rid, token)) for rid, (token, logits) in out.decode.items()]
        for got, want in rows:
            worst = max(worst, max_abs_diff(got, want))
            assert close(got, want), f"{name}: a row differs from transformers by {max_abs_diff(got, want):.3g}"
    assert worst > 0
    _, _, apart = drive(model, mix_prefill=False)
    assert [r.output for r in requests] == [r.output for r in apart]
    for req in requests:
        ids = torch.tensor([req.prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        assert generated[0, len(req.prompt):].tolist() == req.output, f"{name}: request {req.rid}"


def test_mixing_is_the_cpus_default_where_the_family_and_the_model_allow_it():
    model = tiny_model("llama")
    assert ContinuousBatcher(model, max_bs=2, max_context_len=8, backend="cpu").mix_prefill
    assert not ContinuousBatcher(model, max_bs=2, max_context_len=8, backend="cpu", mix_prefill=False).mix_prefill
    for name in ("bloom", "falcon-alibi", "mpt"):
        assert not ContinuousBatcher(tiny_model(name), max_bs=2, max_context_len=8, backend="cpu",
                                     mix_prefill=True).mix_prefill
    with pytest.raises(TypeError, match=r"^ContinuousBatcher: mix_prefill must be True or False or None, got 1$"):
        ContinuousBatcher(model, max_bs=2, max_context_len=8, backend="cpu", mix_prefill=1)


def test_a_model_without_logits_to_keep_never_mixes():
    from test_hf_prefill import NoLogitsToKeep

    engine = ContinuousBatcher(NoLogitsToKeep(tiny_model("llama")).eval(), max_bs=2, max_context_len=8,
                               backend="cpu", mix_prefill=True)
    assert not engine.last_logits_only and not engine.mix_prefill


def test_steps_that_cannot_mix_prefill_apart_with_the_same_tokens(monkeypatch):
    model = tiny_model("qwen2")
    _, steps, plain = drive(model)
    monkeypatch.setattr(batches, "PACKED_MASK_ELEMENTS", 0)  # no packed mask fits
    _, apart_steps, apart = drive(model)
    assert [r.output for r in apart] == [r.output for r in plain]
    assert any(n == 1 and out.decode and out.prefill_logits for out, n in steps)
    assert all(out.decode_graph for out, _ in apart_steps if out.decode)  # every decode replayed a graph
    engine = ContinuousBatcher(model, max_bs=3, max_context_len=32, backend="cpu", eos_token_id=())
    monkeypatch.undo()
    first = engine.add_request(prompt(0, 5), 6)
    engine.step()
    asks = engine.add_request(prompt(1, 4), 3, prompt_logprobs=True)
    out = engine.step()  # admits a request that wants its prompt logprobs: prefill and decode apart
    assert out.decode_graph and set(out.decode) == {first.rid, asks.rid}
    assert len(asks.prompt_logprobs) == 4 and asks.prompt_logprobs[0] is None


def test_a_failed_mixed_step_changes_nothing_and_the_retry_gives_the_same_tokens(monkeypatch):
    model = tiny_model("llama")
    _, _, want = drive(model)
    engine = ContinuousBatcher(model, max_bs=3, max_context_len=32, backend="cpu", eos_token_id=())
    real, calls = computing.packed_logits, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the packed forward failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(computing, "packed_logits", fail_once)
    requests, step, arrived = [], 0, set()
    while step in ARRIVALS or any(s > step for s in ARRIVALS) or not engine.done:
        for length, new in ARRIVALS.get(step, []) if step not in arrived else []:
            requests.append(engine.add_request(prompt(len(requests), length), new))
        arrived.add(step)
        slots, rows = engine.cache.available_slots, engine.cache.available_requests
        outputs = [list(r.output) for r in requests]
        try:
            engine.step()
        except RuntimeError as exc:
            assert str(exc) == "the packed forward failed"
            assert (engine.cache.available_slots, engine.cache.available_requests) == (slots, rows)
            assert [r.output for r in requests] == outputs
            continue  # the same step again
        step += 1
    assert len(calls) >= 3 and [r.output for r in requests] == [r.output for r in want]
