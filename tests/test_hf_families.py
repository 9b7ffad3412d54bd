"""Every tested family decodes through the graphs as transformers does, and the families
graphslot cannot serve are refused at construction with the reason.

Each recipe of ``FAMILIES`` (a tiny random-weight model, built offline) runs a continuous
batch whose decode size changes at every step, on context buckets that its requests
cross, every decode step replaying a graph; every prefill and decode row is compared
(allclose) with the request decoded alone by transformers, and each request's greedy
tokens with ``model.generate``. Then what makes the harder families work, one by one:
the cache's geometry learnt from what the layers write, the 2-D mask route, the
capturable stand-in for Falcon's list indexing, and the refusals.
"""

from __future__ import annotations

import gc

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.graphs.backend import GraphCaptureError  # noqa: E402
from graphslot.integrations.transformers import (  # noqa: E402
    FAMILIES, REFUSED, TESTED_FAMILIES, ContinuousBatcher, HFDecodeAdapter, LayerGeometry, PagedCache,
    PerRequestHF, kv_geometry, tiny_config, tiny_model,
)
from graphslot.integrations.transformers.geometry import bytes_per_slot  # noqa: E402
from graphslot.integrations.transformers.families import _falcon_split_heads, capture_shims  # noqa: E402
from graphslot.integrations.transformers.models import close, max_abs_diff  # noqa: E402

transformers.logging.set_verbosity_error()

#: step -> prompts arriving then (length, new tokens); a request of n new tokens decodes
#: in n - 1 steps from its arrival (its prefill samples the first), so the decode batch is
#: 1, 2, 3, 2, 3, 2, 1, 2, 1 (changing every step) and the contexts cross the bucket 8.
ARRIVALS = {0: [(3, 4)], 1: [(9, 7)], 2: [(5, 2)], 3: [(1, 3)], 4: [(4, 3)], 7: [(12, 3), (2, 2)]}
SIZES = [1, 2, 3, 2, 3, 2, 1, 2, 1]
MAX_BS, BUCKETS = 3, [8, 16, 32]


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """A lazy capture starts with a full garbage collection; with every family's modeling
    module imported and the heap frozen, it walks only what the tests make (about 0.2 s
    less per capture, most of this module's time otherwise)."""
    for recipe in FAMILIES.values():
        getattr(transformers, recipe.model_class)  # transformers imports a family's module lazily
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def prompt(i, length):
    return [(7 * i + 3 * j) % 120 + 2 for j in range(length)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_decodes_like_transformers_and_generates_like_generate(name):
    model = tiny_model(name)
    engine = ContinuousBatcher(model, max_bs=MAX_BS, max_context_len=32, backend="cpu", context_buckets=BUCKETS,
                               lazy=True, eos_token_id=(),  # no EOS: every request runs its max_new_tokens
                               mix_prefill=False)  # every decode step through the graphs (mixed: test_hf_mixed.py)
    ref = PerRequestHF(model)
    requests, sizes, worst = [], [], 0.0
    step = 0
    while step in ARRIVALS or not engine.done:
        for length, new in ARRIVALS.get(step, []):
            requests.append(engine.add_request(prompt(len(requests), length), max_new_tokens=new))
        out = engine.step()
        rows = [(logits, ref.prefill(rid, engine.requests[rid].prompt)) for rid, logits in out.prefill_logits.items()]
        rows += [(logits, ref.decode(rid, token)) for rid, (token, logits) in out.decode.items()]
        for got, want in rows:
            worst = max(worst, max_abs_diff(got, want))
            assert close(got, want), f"{name}: a row differs from transformers by {max_abs_diff(got, want):.3g}"
        sizes.append(out.decode_batch_size)
        step += 1
    assert sizes == SIZES
    metrics = engine.runner.metrics()
    assert metrics["replays"] == len(SIZES) and metrics["eager_fallbacks"] == 0
    assert set(metrics["replays_per_context"]) == {"8", "16"}
    assert 0 < worst < 1e-4
    for req in requests:  # greedy, no EOS: exactly max_new_tokens each
        ids = torch.tensor([req.prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        assert generated[0, len(req.prompt):].tolist() == req.output, f"{name}: request {req.rid}"


def test_the_tested_families_are_exactly_the_recipes():
    assert TESTED_FAMILIES == tuple(dict.fromkeys(recipe.model_type for recipe in FAMILIES.values()))
    assert {"falcon", "opt", "bloom", "gpt2", "deepseek_v3", "mixtral"} <= set(TESTED_FAMILIES)
    for name, recipe in FAMILIES.items():  # offline and tiny
        config = tiny_config(name)
        assert config.model_type == recipe.model_type and config.vocab_size == 128
        assert config.num_hidden_layers == 2


# ------------------------------------------------------------- the geometry probe


@pytest.mark.parametrize("name, layer", [
    ("llama", LayerGeometry(2, 16, 2, 16)),
    ("falcon-mqa", LayerGeometry(1, 16, 1, 16)),  # multi-query: one KV head, whatever the config says
    ("falcon", LayerGeometry(4, 16, 4, 16)),  # new architecture: K and V broadcast to every head first
    ("deepseek_v3", LayerGeometry(1, 16, 1, 8)),  # MLA: the latent (kv_lora_rank) and the rope part
    ("gpt_bigcode", LayerGeometry(1, 16, 1, 16)),
])
def test_the_pool_holds_what_each_layer_writes(name, layer):
    model = tiny_model(name)
    assert kv_geometry(model) == (layer, layer)
    cache = PagedCache(model.config, max_requests=2, max_context_len=16)
    HFDecodeAdapter(model, cache)
    assert cache.geometry == (layer, layer) and cache.geometry_probed
    assert [tuple(k.shape[1:]) for k in cache.pool.k_buffer] == [(layer.k_heads, layer.k_width)] * 2
    assert [tuple(v.shape[1:]) for v in cache.pool.v_buffer] == [(layer.v_heads, layer.v_width)] * 2
    per_slot = 2 * (layer.k_heads * layer.k_width + layer.v_heads * layer.v_width) * 4
    assert bytes_per_slot(kv_geometry(model), torch.float32) == per_slot


def test_a_config_guess_is_replaced_before_the_pool_is_used_and_never_after():
    model = tiny_model("falcon-mqa")
    cache = PagedCache(model.config, max_requests=2, max_context_len=16)
    assert cache.geometry[0] == LayerGeometry(4, 16, 4, 16) and not cache.geometry_probed  # the config's guess
    cache.alloc_request()
    cache.alloc_tokens(1, 0, 3)  # the pool is in use: its geometry can no longer change
    with pytest.raises(RuntimeError, match=r"the pool has requests in it; its geometry cannot change now"):
        cache.probe(model)


def test_a_model_whose_layers_do_not_all_cache_through_update_is_refused():
    model = tiny_model("llama")
    wrong = PagedCache(tiny_config("llama", num_hidden_layers=3), max_requests=2, max_context_len=8)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: decoder layer\(s\) \[2\] of 3 never called "
                                         r"past_key_values.update in a forward"):
        HFDecodeAdapter(model, wrong)


# ------------------------------------------------------------- the 2-D mask route


@pytest.mark.parametrize("name, route", [("bloom", "2d"), ("falcon-alibi", "2d"), ("falcon", "4d"), ("opt", "4d")])
def test_alibi_families_take_a_2d_mask_and_a_query_offset(name, route):
    cache = PagedCache(tiny_config(name), max_requests=2, max_context_len=16)
    assert cache.mask_route == route
    if route == "4d":
        return
    decode = cache.attention_mask(torch.tensor([[3], [9]]))
    assert decode.dtype == torch.int64 and decode.tolist() == [[1] * 4 + [0] * 12, [1] * 10 + [0] * 6]
    assert cache.get_query_offset() == 15  # the 2-D mask alone says what a decode row sees
    with cache.gathering(8):
        assert cache.attention_mask(torch.tensor([[3]])).shape == (1, 8) and cache.get_query_offset() == 7
    prefill = cache.attention_mask(torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]]))  # right-padded rows
    assert cache.get_query_offset() == 0 and prefill[:, :5].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    with pytest.raises(ValueError, match=r"needs each row's token at position p in column p \(rows start at "
                                         r"position 0 in column 0, padded on the right\)"):
        cache.attention_mask(torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]))  # left padding: one offset cannot do it


# ------------------------------------------------------------- Falcon's list indexing


@pytest.mark.parametrize("name", ["falcon", "falcon-mqa", "falcon-alibi"])
def test_the_falcon_stand_in_gives_transformers_values(name):
    model = tiny_model(name)
    attention = model.transformer.h[0].self_attention
    fused = torch.randn(3, 5, attention.query_key_value.out_features)
    want = attention._split_heads(fused)
    with capture_shims(model):
        assert "_split_heads" in vars(attention)
        got = attention._split_heads(fused)
        assert "_split_heads" not in vars(tiny_model("falcon").transformer.h[0].self_attention)  # this model only
    assert "_split_heads" not in vars(attention)  # gone after the block
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == 3
    assert all(torch.equal(g, w) for g, w in zip(_falcon_split_heads(attention, fused), want))


def test_without_the_stand_in_falcon_mqa_cannot_be_captured():
    model = tiny_model("falcon-mqa")
    cache = PagedCache(model.config, max_requests=2, max_context_len=16)

    class Unshimmed(HFDecodeAdapter):
        def forward(self, view):
            with self.cache.gathering(self._bucket):
                return self.run(view)

    from graphslot.runners.decode import DecodeGraphRunner

    with pytest.raises(GraphCaptureError, match=r"host"):
        DecodeGraphRunner(Unshimmed(model, cache), max_bs=1, backend="cpu", progress=False)


# ------------------------------------------------------------- refusals


def test_families_that_would_decode_silently_wrong_are_refused_with_the_reason():
    neo = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=32)).eval()
    cache = PagedCache(tiny_config("llama"), max_requests=2, max_context_len=8)
    with pytest.raises(ValueError, match=r"^GPTNeoForCausalLM: model_type 'gpt_neo' is not supported: its "
                                         r"local-attention layers build their band from the gathered key length"):
        HFDecodeAdapter(neo, cache, allow_untested=True)
    assert "roberta" in REFUSED and "positions" in REFUSED["roberta"]


def test_eager_experts_are_refused_naming_the_fix():
    model = tiny_model("mixtral")
    model.set_experts_implementation("eager")
    cache = PagedCache(model.config, max_requests=2, max_context_len=8)
    with pytest.raises(ValueError, match=r"^MixtralForCausalLM: experts_implementation='eager' cannot be captured: "
                                         r".*model\.set_experts_implementation\('grouped_mm'\)"):
        HFDecodeAdapter(model, cache)
    model.set_experts_implementation("batched_mm")
    HFDecodeAdapter(model, cache)  # a capturable one is served


def test_mpt_longer_than_its_alibi_table_is_refused():
    model = tiny_model("mpt")  # max_seq_len 64
    with pytest.raises(ValueError, match=r"MPT slices its alibi bias to the key length, at most "
                                         r"config\.max_seq_len=64; max_context_len=65 is longer"):
        HFDecodeAdapter(model, PagedCache(model.config, max_requests=1, max_context_len=65))
