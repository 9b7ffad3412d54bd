"""Context buckets: a decode graph per (batch size, context bucket), so a step's attention
costs the bucket of its longest context, not the longest context the cache allows.

The dispatcher's second key (pad_context, context_problem, keys), the ladder, the
runner's capture (eager and lazy) and replay of the expected (bs, L) per step, a step
beyond the largest bucket running eager with its reason, the same tokens and logits as
without buckets, the paged cache gathering only the bucket, and the pool sized by
num_slots. DP ranks agreeing on the bucket: tests/test_dp.py.
"""

from __future__ import annotations

import random

import pytest

from graphslot.runners.dispatch import (
    LONGER_THAN_LARGEST_CONTEXT, SizeDispatcher, context_ladder,
)

# --------------------------------------------------------------------- the dispatcher


def test_the_dispatcher_pads_the_context_to_the_smallest_bucket_that_holds_it():
    d = SizeDispatcher([4, 1, 2], contexts=[64, 16, 32])
    assert d.contexts == [64, 32, 16]
    assert [d.pad_context(n) for n in (0, 1, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
    assert d.context_problem(64) is None and d.context_problem(65) == LONGER_THAN_LARGEST_CONTEXT
    # largest first over both keys: the (max_bs, largest bucket) graph sizes the shared pool
    assert d.keys() == [(4, 64), (4, 32), (4, 16), (2, 64), (2, 32), (2, 16), (1, 64), (1, 32), (1, 16)]
    assert "contexts=[64, 32, 16]" in repr(d)


def test_without_buckets_the_dispatcher_has_one_implicit_bucket():
    d = SizeDispatcher([2, 1])
    assert d.contexts is None and d.pad_context(10**9) is None and d.context_problem(10**9) is None
    assert d.keys() == [(2, None), (1, None)] and "contexts" not in repr(d)


def test_the_auto_ladder_doubles_from_128_up_to_the_longest_context():
    assert context_ladder("auto", 2048) == [2048, 1024, 512, 256, 128]
    assert context_ladder("auto", 1000) == [1000, 512, 256, 128]
    assert context_ladder("auto", 100) == [100]
    assert context_ladder(None, 2048) is None
    assert context_ladder((16, 8, 16), 32) == [16, 8] and context_ladder([8], None) == [8]


@pytest.mark.parametrize("buckets, max_context_len, error, message", [
    ("auto", None, ValueError, r"context_buckets='auto' needs the adapter's max_context_len"),
    ("geometric", 64, ValueError, r"must be None, 'auto' or a sequence of lengths, got 'geometric'"),
    (8, 64, TypeError, r"must be None, 'auto' or a sequence of lengths, got int"),
    ([], 64, ValueError, r"must be ints >= 1 \(at least one\), got \[\]"),
    ([8, 0], 64, ValueError, r"must be ints >= 1 \(at least one\), got \[8, 0\]"),
    ([8, True], 64, ValueError, r"must be ints >= 1"),
    ([8, 2.0], 64, ValueError, r"must be ints >= 1"),
    ([8, 128], 64, ValueError, r"context_buckets \[8, 128\]: 128 is beyond the adapter's max_context_len 64"),
])
def test_a_bad_ladder_is_refused_naming_it(buckets, max_context_len, error, message):
    with pytest.raises(error, match=message):
        context_ladder(buckets, max_context_len)


# ------------------------------------------------------------------ through the runner

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from graphslot.integrations.transformers import (  # noqa: E402
    ContinuousBatcher, DecodeStep, HFDecodeAdapter, LayerGeometry, PagedCache, PerRequestHF, tiny_config,
    tiny_model,
)
from graphslot.integrations.transformers.budget import pool_size  # noqa: E402
from graphslot.integrations.transformers.geometry import bytes_per_slot, config_geometry  # noqa: E402
from graphslot.integrations.transformers.models import close, max_abs_diff  # noqa: E402
from graphslot.runners.decode import DecodeGraphRunner  # noqa: E402
from graphslot.tools import audit_external_inputs  # noqa: E402

BUCKETS = [8, 16, 32]
MAX_CONTEXT = 40
#: (prompt length, new tokens) of requests arriving at each step: contexts cross 8, 16 and 32.
ARRIVALS = {0: [(3, 12)], 1: [(6, 9)], 2: [(12, 14)], 4: [(1, 5), (20, 12)], 9: [(5, 26)]}


class Recorded:
    """The (bs, context) each replayed step ran, read off the runner's prepared replays."""

    def __init__(self, runner):
        self.keys, launch = [], runner.launch

        def recording(step):
            self.keys.append((step.bs, step.context))
            return launch(step)

        runner.launch = recording


def drive(engine, seed=0):
    """Run ARRIVALS to the end; per step its output and its decode's longest context (a
    request's context after the step: its prompt and outputs, less the last token sampled)."""
    rng = random.Random(seed)
    steps, step = [], 0
    while step in ARRIVALS or not engine.done:
        for length, new in ARRIVALS.get(step, []):
            engine.add_request([rng.randrange(1, 128) for _ in range(length)], max_new_tokens=new)
        out = engine.step()
        reqs = [engine.requests[rid] for rid in out.decode]
        steps.append((out, max((len(r.prompt) + len(r.output) - 1 for r in reqs), default=0)))
        step += 1
    return steps


def engine_for(model, **options):
    # every decode step through the graphs (mixed prefill steps: tests/test_hf_mixed.py)
    return ContinuousBatcher(model, max_bs=4, max_context_len=MAX_CONTEXT, backend="cpu", mix_prefill=False, **options)


def test_buckets_give_the_tokens_and_logits_of_no_buckets():
    model = tiny_model("qwen2")  # a sliding layer and a full one: both masks follow the bucket
    plain, bucketed = engine_for(model, context_buckets=None), engine_for(model, context_buckets=BUCKETS)
    ref = PerRequestHF(model)
    a, b = drive(plain), drive(bucketed)
    assert len(a) == len(b) > 20
    rows = 0
    for (out_a, _), (out_b, _) in zip(a, b):
        assert out_a.decode.keys() == out_b.decode.keys()
        for rid, (token, logits) in out_b.decode.items():
            assert token == out_a.decode[rid][0]
            assert close(logits, out_a.decode[rid][1]), max_abs_diff(logits, out_a.decode[rid][1])
            rows += 1
    assert rows > 70
    for rid, req in bucketed.requests.items():
        assert req.output == plain.requests[rid].output
    # and both are what transformers computes for each request alone
    for out, _ in b:
        for rid, logits in out.prefill_logits.items():
            assert close(logits, ref.prefill(rid, bucketed.requests[rid].prompt))
        for rid, (token, logits) in out.decode.items():
            assert close(logits, ref.decode(rid, token))
    assert bucketed.runner.metrics()["eager_fallbacks"] == plain.runner.metrics()["eager_fallbacks"] == 0
    assert "replays_per_context" not in plain.runner.metrics()


def test_the_batcher_buckets_contexts_by_default():
    engine = ContinuousBatcher(tiny_model("llama", max_position_embeddings=1024), max_bs=2, max_context_len=300,
                               backend="cpu", lazy=True)
    assert engine.runner.captured_contexts == [300, 256, 128]
    req = engine.add_request([5, 17, 3], 4)
    while not engine.done:
        engine.step()
    assert len(req.output) == 4 and set(engine.runner.graphs) == {(1, 128)}
    assert engine.runner.metrics()["eager_fallbacks"] == 0


def test_each_step_replays_the_graph_of_its_batch_size_and_longest_context():
    engine = engine_for(tiny_model("llama"), context_buckets=BUCKETS)
    recorded = Recorded(engine.runner)
    steps = drive(engine)
    expected = [(min(s for s in (1, 2, 4) if s >= out.decode_batch_size),
                 min(n for n in BUCKETS if n >= longest)) for out, longest in steps if out.decode_batch_size]
    assert recorded.keys == expected
    assert {context for _, context in expected} == set(BUCKETS)  # every bucket served some step
    counts = engine.runner.metrics()["replays_per_context"]
    assert counts == {str(n): sum(1 for _, c in expected if c == n) for n in BUCKETS}


def test_a_step_beyond_the_largest_bucket_runs_eager_naming_why():
    model = tiny_model("mistral")
    engine = engine_for(model, context_buckets=[8, 16])
    ref = PerRequestHF(model)
    steps = drive(engine)
    beyond = [out for out, longest in steps if out.decode_batch_size and longest > 16]
    within = [out for out, longest in steps if out.decode_batch_size and longest <= 16]
    assert beyond and within
    assert all(not out.decode_graph for out in beyond) and all(out.decode_graph for out in within)
    metrics = engine.runner.metrics()
    assert metrics["eager_reasons"] == {"context longer than the largest context bucket": len(beyond)}
    assert metrics["replays"] == len(within)
    for out, _ in steps:  # the eager steps gather max_context_len and are as right as the graphs
        for rid, logits in out.prefill_logits.items():
            assert close(logits, ref.prefill(rid, engine.requests[rid].prompt))
        for rid, (token, logits) in out.decode.items():
            assert close(logits, ref.decode(rid, token))
    step = three_requests(engine.cache, [3, 20, 5])
    assert engine.runner.eager_reason(step) == "context longer than the largest context bucket"
    with pytest.raises(ValueError, match=r"longest context is 21 has no graph: the largest context bucket is 16"):
        engine.runner.prepare(step)


def three_requests(cache, lengths):
    """A decode step of requests already holding ``lengths`` tokens (their slots allocated)."""
    rows, slots = [], []
    for n in lengths:
        row = cache.alloc_request()
        rows.append(row)
        slots.append(cache.alloc_tokens(row, 0, n + 1)[-1])
    lens = torch.tensor([n + 1 for n in lengths])
    return DecodeStep(torch.tensor([7] * len(lengths)), lens - 1, torch.tensor(slots), torch.tensor(rows), lens,
                      lens, len(lengths))


def test_every_pair_is_captured_largest_first_or_each_when_first_needed():
    model = tiny_model("llama")
    eager = engine_for(model, context_buckets=BUCKETS)
    assert list(eager.runner.graphs) == [(bs, n) for bs in (4, 2, 1) for n in (32, 16, 8)]
    assert eager.runner.graph_keys == list(eager.runner.graphs)
    assert eager.runner.captured_contexts == [32, 16, 8]
    assert "contexts=[32, 16, 8]" in repr(eager.runner)

    lazy = engine_for(model, context_buckets=BUCKETS, lazy=True)
    assert lazy.runner.graphs == {} and lazy.runner.capture_seconds == 0
    recorded = Recorded(lazy.runner)
    drive(lazy)
    assert set(lazy.runner.graphs) == set(recorded.keys) and len(lazy.runner.graphs) < 9
    with pytest.raises(KeyError, match=r"context bucket 12 is not among the runner's context buckets \[32, 16, 8\]"):
        lazy.runner.graph(4, 12)
    with pytest.raises(KeyError, match=r"context bucket None is not among"):
        lazy.runner.graph(4)

    plain = engine_for(model, capture_bs=[2, 1], context_buckets=None)
    assert list(plain.runner.graphs) == [2, 1] and plain.runner.graph_keys == [(2, None), (1, None)]
    assert plain.runner.captured_contexts is None
    with pytest.raises(KeyError, match=r"context bucket 8 given, but the runner has no context buckets"):
        plain.runner.graph(2, 8)


def test_each_graph_gathers_its_bucket_and_reads_no_stale_input():
    engine = engine_for(tiny_model("qwen2"), context_buckets=[8, 32], capture_bs=[2])
    runner, cache = engine.runner, engine.cache
    for bs, context in runner.graph_keys:
        assert runner.external_inputs(bs, context) == []
    assert audit_external_inputs(runner) == []
    # the cache gathers and masks the bucket it is told, and max_context_len otherwise
    step = three_requests(cache, [3, 5])
    positions = step.positions.view(2, 1)
    with cache.gathering(8):
        assert cache.attention_mask(positions)["full_attention"].shape == (2, 1, 1, 8)
        cache.bind(step.out_cache_loc, step.req_pool_indices)
        keys, values = cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
        assert keys.shape == values.shape == (2, 2, 8, 16)
        assert cache.layers[0].get_mask_sizes(1) == (8, 0)
    assert cache.gather_len is None and cache.layers[0].get_mask_sizes(1) == (MAX_CONTEXT, 0)
    assert cache.attention_mask(positions)["full_attention"].shape == (2, 1, 1, MAX_CONTEXT)
    with pytest.raises(ValueError, match=r"a gather length of 41; it must be 1\.\.max_context_len \(40\)"):
        with cache.gathering(41):
            pass


def test_without_buckets_the_adapter_hooks_are_never_called():
    model = tiny_model("llama")
    cache = PagedCache(model.config, max_requests=8, max_context_len=16)
    calls = []

    class Watching(HFDecodeAdapter):
        def context_len(self, fb):
            calls.append("context_len")
            return super().context_len(fb)

        def set_context_bucket(self, context_len):
            calls.append(context_len)
            super().set_context_bucket(context_len)

    runner = DecodeGraphRunner(Watching(model, cache), max_bs=4, backend="cpu", progress=False)
    runner(three_requests(cache, [2, 4, 3]))
    assert calls == [] and runner.metrics()["replays"] == 1

    bucketed = DecodeGraphRunner(Watching(model, cache), max_bs=4, backend="cpu", progress=False,
                                 context_buckets=[8, 16], capture_bs=[4])
    assert calls == ["context_len", 16, 8]  # checked on the dummy batch, then each capture told its bucket
    calls.clear()
    bucketed(three_requests(cache, [2, 9, 3]))
    assert calls == ["context_len", 16]  # read once per step; the bucket told before the fill


def test_the_default_context_len_reads_the_host_lengths_only():
    model = tiny_model("llama")
    adapter = HFDecodeAdapter(model, PagedCache(model.config, max_requests=2, max_context_len=16))
    step = DecodeStep(*(torch.zeros(3, dtype=torch.int64),) * 5, torch.tensor([4, 9, 2, 30]), 3)
    assert adapter.context_len(step) == 9  # the batch's rows only
    assert adapter.context_len(adapter.make_dummy_batch(4, 4)) == 0
    assert adapter.max_context_len == 16

    class NoHostLens:
        batch_size = 1

    with pytest.raises(AttributeError, match=r"has no `seq_lens_cpu`; context buckets need each step's longest "
                                             r"context from the host: override DecodeAdapter\.context_len"):
        adapter.context_len(NoHostLens())


# ------------------------------------------------------------ the pool sized by memory


def test_the_pool_is_sized_by_num_slots_not_requests_times_context():
    config = tiny_config("llama")  # 2 layers x (K and V) x 2 KV heads x 16 x 4 bytes = 512 bytes a slot
    geometry = config_geometry(config)
    assert bytes_per_slot(geometry, torch.float32) == 512 and bytes_per_slot(geometry, torch.bfloat16) == 256
    mla = [LayerGeometry(1, 16, 1, 8)] * 2  # what an MLA model writes (kv_geometry): 2 x 24 x 4 bytes a slot
    assert bytes_per_slot(mla, torch.float32) == 192
    # a budget of 100 slots and the table of 5 rows x 4096 positions, whatever 4 x 4096 would need
    size = pool_size(512, torch.device("cpu"), max_requests=4, max_context_len=99, positions=None,
                     kv_cache_bytes=512 * 100 + 5 * 99 * 8 + 511)
    assert size[:2] == (100, 99)
    cache = PagedCache(config, max_requests=4, max_context_len=4096, num_slots=100)
    assert [b.shape for b in cache.pool.k_buffer] == [(100, 2, 16)] * 2 and cache.available_slots == 99
    assert cache.req_to_token_pool.req_to_token.shape == (5, 4096)
    with pytest.raises(ValueError, match=r"num_slots must be an int >= 2"):
        PagedCache(config, max_requests=4, max_context_len=64, num_slots=1)


def test_a_pool_sized_by_num_slots_names_it_when_over_the_cap():
    from graphslot.spec.budget import BufferBudgetError

    with pytest.raises(BufferBudgetError, match=r"^PagedCache: num_slots=1000000 \(max_requests=4, max_context_len="
                                                r"64\) needs a KV pool of 1000000 slots x 2 layers x 2 KV heads x "
                                                r"head_dim 16 x 2 \(K and V\) x 4 bytes = 512000000 bytes .* Lower "
                                                r"num_slots, max_requests"):
        PagedCache(tiny_config("llama"), max_requests=4, max_context_len=64, num_slots=10**6, max_bytes=10**8)


def test_a_batcher_on_a_small_pool_decodes_long_contexts():
    """max_context_len far beyond what max_requests x max_context_len slots would hold."""
    model = tiny_model("llama", max_position_embeddings=4096)
    cache = PagedCache(model.config, max_requests=4, max_context_len=4096, num_slots=64)
    runner = DecodeGraphRunner(HFDecodeAdapter(model, cache), max_bs=4, backend="cpu", progress=False,
                               context_buckets="auto", lazy=True)
    assert runner.captured_contexts == [4096, 2048, 1024, 512, 256, 128]
    step = three_requests(cache, [5, 11, 2])
    got = runner(step)
    assert runner.graphs.keys() == {(4, 128)}
    want = HFDecodeAdapter(model, cache).forward_eager(step)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
