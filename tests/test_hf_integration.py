"""transformers models decode through the graph runner as plain transformers does, per request.

The Llama-like families (tiny random-weight config, GQA; Mistral with a sliding window
on every layer, Qwen2 on one of two) run a long continuous batch whose decode size
changes at every step, with requests joining, finishing and being aborted; every
prefill and decode row is compared (allclose) with the same request decoded alone by
transformers with a ``DynamicCache``. tests/test_hf_families.py runs every recipe of
``FAMILIES`` through a shorter one.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

import graphslot as gs  # noqa: E402
from graphslot.integrations.transformers import (  # noqa: E402
    FAMILIES, TESTED_FAMILIES, ContinuousBatcher, DecodeStep, HFDecodeAdapter, PagedCache, PerRequestHF,
    attention_layers, tiny_config, tiny_model,
)
from graphslot.integrations.transformers.batches import decode_step  # noqa: E402
from graphslot.integrations.transformers.models import close, max_abs_diff  # noqa: E402
from graphslot.runners.decode import DecodeGraphRunner  # noqa: E402

#: Decode batch size of each step: a different size every step, padded and exact.
TARGETS = [1, 3, 2, 5, 4, 6, 3, 1, 4, 2, 6, 5, 3, 6, 1, 2]
MAX_BS = 6
#: The families this module drives at length (every family: tests/test_hf_families.py).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


def drive(family, targets=TARGETS, seed=0, **model_kwargs):
    """Run the batcher to the target sizes, checking every row against per-request HF."""
    model = tiny_model(family, seed=seed, **model_kwargs)
    # every decode step through the graph (mixed prefill steps: tests/test_hf_mixed.py)
    engine = ContinuousBatcher(model, max_bs=MAX_BS, max_context_len=40, backend="cpu", mix_prefill=False)
    ref = PerRequestHF(model)
    rng = random.Random(seed)
    stats = {"sizes": [], "graph_steps": 0, "finished": 0, "aborted": 0, "rows": 0, "worst": 0.0}

    def check(rid, got, want):
        stats["rows"] += 1
        stats["worst"] = max(stats["worst"], max_abs_diff(got, want))
        assert close(got, want), f"{family}: request {rid} differs from transformers by {max_abs_diff(got, want):.3g}"

    for target in targets:
        running = len(engine.running)
        for _ in range(target - running):  # join
            prompt = [rng.randrange(1, 128) for _ in range(rng.randint(1, 14))]
            engine.add_request(prompt, max_new_tokens=rng.randint(2, 14))
        for req in list(engine.running)[: max(running - target, 0)]:  # leave early
            engine.abort(req.rid)
            ref.drop(req.rid)
            stats["aborted"] += 1
        out = engine.step()
        for rid, logits in out.prefill_logits.items():
            check(rid, logits, ref.prefill(rid, engine.requests[rid].prompt))
        for rid, (token, logits) in out.decode.items():
            check(rid, logits, ref.decode(rid, token))
        for rid in out.finished:
            ref.drop(rid)
        stats["finished"] += len(out.finished)
        stats["sizes"].append(out.decode_batch_size)
        stats["graph_steps"] += out.decode_graph
    return engine, stats


@pytest.mark.parametrize("family", LLAMA_LIKE)
def test_each_family_decodes_like_transformers_per_request(family):
    engine, stats = drive(family)
    assert stats["sizes"] == TARGETS  # the decode batch changed size at every step
    assert stats["graph_steps"] == len(TARGETS)  # every decode step replayed a graph
    assert engine.runner.captured_sizes == [6, 4, 2, 1]
    assert set(TARGETS) - set(engine.runner.captured_sizes)  # some steps were padded
    assert stats["finished"] > 0 and stats["aborted"] > 0
    assert stats["rows"] > 60 and stats["worst"] < 1e-4
    for bs, context in engine.runner.graph_keys:
        assert engine.runner.external_inputs(bs, context) == []
        # each layer's K and V are gathered into tensors made for them (out=): replay writes there
        # directly, where a result in new memory would be copied into them after every replay
        ops = engine.runner.graphs[(bs, context)].ops
        assert ops.count("aten.index_select.out") == 2 * engine.model.config.num_hidden_layers


def test_eager_attention_takes_the_same_mask():
    _, stats = drive("llama", targets=TARGETS[:6], attn_implementation="eager")
    assert stats["graph_steps"] == 6 and stats["rows"] > 15


def test_layer_kinds_of_the_tiny_configs():
    assert attention_layers(tiny_config("llama")) == [("full_attention", None)] * 2
    assert attention_layers(tiny_config("mistral")) == [("sliding_attention", 8)] * 2
    assert attention_layers(tiny_config("qwen2")) == [("full_attention", None), ("sliding_attention", 8)]
    cache = PagedCache(tiny_config("qwen2"), max_requests=2, max_context_len=16)
    masks = cache.attention_mask(torch.tensor([[12]]))
    assert set(masks) == {"full_attention", "sliding_attention"}
    seen = {kind: (m[0, 0, 0] == 0).nonzero().view(-1).tolist() for kind, m in masks.items()}
    assert seen == {"full_attention": list(range(13)), "sliding_attention": list(range(5, 13))}


def test_the_batch_type_is_a_frozen_dataclass_and_is_never_written():
    model = tiny_model("qwen3")
    engine = ContinuousBatcher(model, max_bs=4, max_context_len=24, backend="cpu")
    for n in (3, 5, 2):
        engine.add_request(list(range(1, n + 1)), max_new_tokens=5)
    engine.step()
    reqs = engine.running
    locs = [engine.cache.alloc_tokens(r.row, r.cached, 1)[0] for r in reqs]
    batch = decode_step(engine.cache.device, [4, 5, 6], [r.cached for r in reqs], [r.row for r in reqs], locs)
    assert dataclasses.fields(DecodeStep) and DecodeStep.__dataclass_params__.frozen
    ids = batch.input_ids
    logits = engine.runner(batch)
    assert logits.shape == (3, 128) and batch.batch_size == 3 and batch.input_ids is ids


# --------------------------------------------------------------- forward's outputs


class ModelOutputAdapter(HFDecodeAdapter):
    """forward returns what the model returns (a CausalLMOutputWithPast)."""

    keep_cache = True

    def run(self, step):
        bs = self.batch_size(step)
        ids, pos = step.input_ids.view(bs, -1), step.positions.view(bs, -1)
        self.cache.bind(step.out_cache_loc, step.req_pool_indices)
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=self.cache, use_cache=True,
                             attention_mask=self.cache.attention_mask(pos))
        return out if self.keep_cache else CausalLMOutputWithPast(logits=out.logits)


def three_request_step(cache):
    rows, slots = [], []
    for length in (3, 5, 2):
        row = cache.alloc_request()
        rows.append(row)
        slots.append(cache.alloc_tokens(row, 0, length + 1)[-1])
    lens = torch.tensor([4, 6, 3])
    return DecodeStep(torch.tensor([7, 8, 9]), lens - 1, torch.tensor(slots), torch.tensor(rows), lens, lens, 3)


@pytest.mark.parametrize("keep_cache, share_outputs", [(False, False), (False, True), (True, False)],
                         ids=["logits-only", "logits-only-shared", "with-cache"])
def test_a_model_output_comes_back_with_raw_rows_or_fails_loudly(keep_cache, share_outputs):
    model = tiny_model("llama")
    cache = PagedCache(model.config, max_requests=4, max_context_len=16)
    adapter = ModelOutputAdapter(model, cache)
    adapter.keep_cache = keep_cache
    runner = DecodeGraphRunner(adapter, max_bs=4, backend="cpu", progress=False, share_outputs=share_outputs)
    step = three_request_step(cache)
    assert runner.padded_bs(step) == 4
    if keep_cache:
        # The field is past_key_values up to transformers 5.23, cache from 5.24.
        with pytest.raises(TypeError, match=r"^output\.(past_key_values|cache): the runner cannot cut the padded "
                                            r"rows out of a graphslot\.integrations\.transformers\.cache\.PagedCache"):
            runner(step)
        return
    out = runner(step)
    assert type(out) is CausalLMOutputWithPast and out.logits.shape == (3, 1, 128)  # not 4 rows
    assert list(out.keys()) == ["logits"] and out[0] is out.logits
    assert torch.allclose(out.logits[:, 0], adapter.forward_eager(step).logits[:, 0], atol=1e-5, rtol=1e-4)
    if share_outputs:  # a ModelOutput is a pytree: its logits went to the one shared buffer
        (shared,) = runner.shared_outputs.tensors()
        assert out.logits.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()


# ------------------------------------------------------------------ refusals


def test_an_adapter_missing_a_field_fails_at_construction_naming_it():
    @dataclasses.dataclass(frozen=True)
    class NoHostLens:
        input_ids: torch.Tensor
        positions: torch.Tensor
        out_cache_loc: torch.Tensor
        req_pool_indices: torch.Tensor
        seq_lens: torch.Tensor
        batch_size: int

    class Forgetful(HFDecodeAdapter):
        def make_dummy_batch(self, bs, num_tokens):
            e = torch.zeros(0, dtype=torch.int64)
            return NoHostLens(e, e, e, e, e, 0)

    model = tiny_model("llama")
    adapter = Forgetful(model, PagedCache(model.config, max_requests=2, max_context_len=8))
    with pytest.raises(gs.SlotError, match=r"^spec 'decode': the NoHostLens from Forgetful\.make_dummy_batch has "
                                           r"no 'seq_lens_cpu'"):
        DecodeGraphRunner(adapter, max_bs=2, backend="cpu", progress=False)


def test_models_the_adapter_would_run_wrong_are_refused():
    cache = PagedCache(tiny_config("llama"), max_requests=2, max_context_len=8)
    codegen = transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, rotary_dim=4, bos_token_id=0, eos_token_id=0)).eval()
    assert "codegen" not in TESTED_FAMILIES
    with pytest.raises(ValueError, match=r"model_type 'codegen'\) is not a tested family \(llama, mistral, qwen2, "
                                         r"qwen3, .*\); pass allow_untested=True"):
        HFDecodeAdapter(codegen, cache)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="is in training mode"):
        HFDecodeAdapter(model.train(), cache)
    model.eval().config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="uses attn_implementation 'flash_attention_2'"):
        HFDecodeAdapter(model, cache)


def test_the_paged_cache_has_no_single_length_and_requests_must_fit():
    model = tiny_model("mistral")
    engine = ContinuousBatcher(model, max_bs=2, max_context_len=8, backend="cpu")
    # Callers pass position_ids and a mask; what some families ask the cache is only used to derive those.
    assert engine.cache.get_seq_length() == 0 and engine.cache.layers[1].get_seq_length() == 0
    with pytest.raises(ValueError, match="needs 9 cache positions, more than max_context_len=8"):
        engine.add_request([1, 2, 3, 4], max_new_tokens=6)
    with pytest.raises(ValueError, match=r"unknown model family 'gpt_neo'; tested: llama, mistral, qwen2, qwen3, "):
        tiny_model("gpt_neo")
    assert set(TESTED_FAMILIES) == {recipe.model_type for recipe in FAMILIES.values()}


def test_the_cache_goes_under_the_keyword_the_forward_declares():
    """transformers 5.24 renames the forward's past_key_values to cache (the old name
    warns on every call); older releases know only past_key_values."""
    from graphslot.integrations.transformers.forward import with_cache

    class New:
        def forward(self, input_ids=None, cache=None):
            pass

    class Old:
        def forward(self, input_ids=None, past_key_values=None):
            pass

    marker = object()
    assert with_cache(New(), marker) == {"cache": marker}
    assert with_cache(Old(), marker) == {"past_key_values": marker}


def test_a_batcher_decodes_without_a_deprecation_warning():
    import warnings

    from graphslot.integrations.transformers import ContinuousBatcher

    engine = ContinuousBatcher(tiny_model("llama", seed=0), max_bs=4, max_context_len=32, backend="cpu")
    request = engine.add_request([1, 2, 3, 4], max_new_tokens=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for _ in range(3):
            engine.step()
    assert len(request.output) == 3
