"""Every phase x capture mode on a transformers Llama, on the CPU tape.

A small serving loop (:class:`Server`) admits six requests in three prefill waves (one
prompt split over two waves: chunked prefill after a cached prefix) and decodes every
running request each step, freeing each when done, so the decode batch size and the
prefill token count change at every step, captured sizes and padded ones. One phase
runs through a graph runner in one capture mode, the other eagerly; every step's
logits are compared with the eager forward of the same step, and the greedy tokens
with ``model.generate`` per request.

Logits are compared ``allclose``, not bit for bit: a graph computes a step at its
padded size and the CPU's matmul picks kernels by row count (decode: 2e-6 apart here),
and a ``full`` prefill graph attends over its request slots' ``max_context_len``
positions where eager attends over the batch's longest context. (The breakable and
piecewise prefill graphs gave eager's bits on this CPU; not asserted.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from graph_counting import replays_one_step  # noqa: E402

from graphslot.integrations.transformers import HFDecodeAdapter, PagedCache, tiny_model  # noqa: E402
from graphslot.integrations.transformers.attention import ROUTED_FAMILIES, route_attention  # noqa: E402
from graphslot.integrations.transformers.batches import decode_step  # noqa: E402
from graphslot.integrations.transformers.models import close  # noqa: E402
from graphslot.integrations.transformers.prefill import HFPrefillAdapter, prefill_step  # noqa: E402
from graphslot.graphs.backend import graph_pool  # noqa: E402
from graphslot.runners import DecodeGraphRunner, PrefillGraphRunner  # noqa: E402

MODES = ("full", "breakable", "piecewise")
PROMPTS = [[5, 9, 17], [3, 44, 2, 91, 7, 60, 12], [70, 8], [33, 1, 64, 22, 101], [9, 9, 40, 77, 3, 58, 11, 6, 120],
           [14, 99, 2, 36]]
MAX_NEW = [7, 2, 4, 3, 4, 2]
#: Prefill waves: ``(request, first, end)`` prompt slices; request 4 is prefilled in two chunks.
WAVES = [[(0, 0, 3), (1, 0, 7)], [(2, 0, 2), (3, 0, 5), (4, 0, 5)], [(4, 5, 9), (5, 0, 4)]]
TOKEN_BUCKETS = [8, 16]
CAPTURE_BS = [2, 6]
MAX_CONTEXT = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def generate(model):
    """Greedy tokens of ``model.generate`` per request."""
    out = []
    for prompt, n in zip(PROMPTS, MAX_NEW):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def generated(model):
    return generate(model)


class Server:
    """Runs :data:`WAVES` and decode steps: a wave, a decode step, ... then decode steps
    until every request is done. ``prefill(step)`` returns logits ``[tokens, vocab]``,
    ``decode(step)`` ``[requests, vocab]``."""

    def __init__(self, cache: PagedCache, prefill, decode):
        self.cache, self.prefill, self.decode = cache, prefill, decode
        self.rows, self.slots, self.tokens = {}, {}, {}
        self.prefill_tokens, self.decode_sizes = [], []

    def run(self):
        for wave in WAVES:
            self.prefill_wave(wave)
            self.decode_step()
        while self.decode_step():
            pass
        assert self.cache.available_requests == self.cache.max_requests  # every row given back
        return [self.tokens[r] for r in range(len(PROMPTS))]

    def prefill_wave(self, wave):
        chunks = []
        for rid, first, end in wave:
            if rid not in self.rows:
                self.rows[rid] = self.cache.alloc_request()
            row = self.rows[rid]
            slots = self.cache.alloc_tokens(row, first, end - first)
            self.slots.setdefault(rid, []).extend(slots)
            chunks.append((row, first, PROMPTS[rid][first:end], slots))
        step = prefill_step(self.cache.device, chunks)
        logits = self.prefill(step)
        self.prefill_tokens.append(logits.shape[0])
        last = -1
        for rid, first, end in wave:
            last += end - first
            if end == len(PROMPTS[rid]):
                self.tokens[rid] = [int(logits[last].argmax())]

    def decode_step(self) -> bool:
        running = [r for r, toks in self.tokens.items() if len(toks) < MAX_NEW[r]]
        if not running:
            return False
        positions = [len(PROMPTS[r]) + len(self.tokens[r]) - 1 for r in running]
        locs = [self.cache.alloc_tokens(self.rows[r], p, 1)[0] for r, p in zip(running, positions)]
        for r, loc in zip(running, locs):
            self.slots[r].append(loc)
        step = decode_step(self.cache.device, [self.tokens[r][-1] for r in running], positions,
                           [self.rows[r] for r in running], locs)
        logits = self.decode(step)
        self.decode_sizes.append(len(running))
        for r, row in zip(running, logits):
            self.tokens[r].append(int(row.argmax()))
            if len(self.tokens[r]) == MAX_NEW[r]:
                self.cache.free_request(self.rows.pop(r), self.slots.pop(r))
        return True


def new_cache(model):
    return PagedCache(model.config, max_requests=6, max_context_len=MAX_CONTEXT)


def prefill_runner(adapter, capture, **kwargs):
    """On the CPU tape, which counts its graphs' replays (``runner.backend.replays``)."""
    return PrefillGraphRunner(adapter, capture=capture, max_bs=4, token_buckets=TOKEN_BUCKETS, backend="cpu",
                              progress=False, **kwargs)


def decode_runner(adapter, capture, **kwargs):
    """On the CPU tape, which counts its graphs' replays (``runner.backend.replays``)."""
    return DecodeGraphRunner(adapter, capture=capture, max_bs=6, capture_bs=CAPTURE_BS, backend="cpu",
                             progress=False, **kwargs)


def checked(runner, eager, same, graphs_run):
    """``runner`` on each step, after checking it can replay a graph, checking that it did
    (counted by the backend's graphs) and comparing it with ``eager`` on the same step
    (eager first: the runner's K and V are what later steps read)."""

    def step(fb):
        assert runner.can_run(fb), runner.eager_reason(fb)
        want = eager(fb)
        with replays_one_step(runner):
            got = runner(fb)
        assert same(got, want), f"differs from eager by {float((got - want).abs().max()):.3g}"
        graphs_run.append(fb)
        return got

    return step


def assert_cut_at_attention(runner, capture, model):
    """Each graph runs every layer's attention eagerly (once per layer) unless ``full``, and
    reads nothing but declared static tensors (tape: each op's inputs are known)."""
    for key in runner.graph_keys:
        graph = runner.graphs[key if key[1] is not None else key[0]]
        cuts = getattr(graph, "num_eager_steps", 0)
        assert cuts == (0 if capture == "full" else model.config.num_hidden_layers), (key, graph)
        assert runner.external_inputs(*key) == []


@pytest.mark.parametrize("capture", MODES)
def test_decode_graphs_give_the_eager_logits_and_generates_tokens(model, generated, capture):
    cache = new_cache(model)
    adapter = HFDecodeAdapter(model, cache)
    runner = decode_runner(adapter, capture)
    prefill = HFPrefillAdapter(model, cache)
    run = []
    server = Server(cache, prefill.forward_eager, checked(runner, adapter.forward_eager, close, run))
    assert server.run() == generated
    sizes = server.decode_sizes
    assert all(a != b for a, b in zip(sizes, sizes[1:])), sizes  # a new batch size every step
    assert set(sizes) - set(CAPTURE_BS) and set(sizes) & set(CAPTURE_BS), sizes  # padded and exact
    assert len(run) == len(sizes)
    assert_cut_at_attention(runner, capture, model)


@pytest.mark.parametrize("capture", MODES)
def test_prefill_graphs_give_the_eager_logits_and_generates_tokens(model, generated, capture):
    cache = new_cache(model)
    adapter = HFPrefillAdapter(model, cache)
    runner = prefill_runner(adapter, capture)
    decode = HFDecodeAdapter(model, cache)
    run = []
    server = Server(cache, checked(runner, adapter.forward_eager, close, run), decode.forward_eager)
    assert server.run() == generated
    assert server.prefill_tokens == [10, 12, 8]  # padded to 16, 16 and exactly 8
    assert len(run) == len(WAVES)
    assert_cut_at_attention(runner, capture, model)
    # capture="full": the attention metadata is in the graph, so a graph per request-slot count too
    assert all(requests is not None for _, requests in runner.graph_keys) == (capture == "full")


def test_prefill_and_decode_graphs_together(model, generated):
    """Both phases through graphs, in one graph pool (the engine's)."""
    cache, pool = new_cache(model), graph_pool("cpu")
    prefill = prefill_runner(HFPrefillAdapter(model, cache), "full", graph_pool=pool)
    decode = decode_runner(HFDecodeAdapter(model, cache), "breakable", graph_pool=pool)
    assert prefill.graph_pool is decode.graph_pool is pool
    server = Server(cache, prefill, decode)
    assert server.run() == generated
    assert prefill.backend.replays == len(WAVES) and decode.backend.replays >= len(server.decode_sizes)


@pytest.mark.parametrize("family", [f for f in ROUTED_FAMILIES if f != "llama"])
def test_the_other_routed_families(family):
    """Sliding windows on every layer (Mistral) or some (Qwen2), q/k norms (Qwen3): the
    prefill graph's in-graph mask is per layer type, the decode graph cuts at attention."""
    model = tiny_model(family)
    want = generate(model)
    cache = new_cache(model)
    prefill = prefill_runner(HFPrefillAdapter(model, cache), "full")
    decode = decode_runner(HFDecodeAdapter(model, cache), "breakable")
    assert Server(cache, prefill, decode).run() == want
    assert prefill.backend.replays == len(WAVES) and decode.backend.replays > 0


def reload_weights(model):
    """New tensors for every MLP down projection (what a weight loader's ``p.data = new``
    does): graphs captured before read the old memory."""
    generator = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        weight = layer.mlp.down_proj.weight
        weight.data = torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * weight.std() * 3


def test_recapture_after_new_weights_gives_their_tokens_and_release_keeps_them(generated):
    """The weights reloaded: the graphs are stale (the old tokens) until ``recapture``
    (the new model's tokens); ``release`` then runs eager, with the same tokens."""
    model = tiny_model("llama")  # its own: the weights change
    cache = new_cache(model)
    prefill = prefill_runner(HFPrefillAdapter(model, cache), "full")
    decode = decode_runner(HFDecodeAdapter(model, cache), "full")
    assert Server(cache, prefill, decode).run() == generated
    reload_weights(model)
    fresh = generate(model)
    assert fresh != generated, "the new weights change no token: the test would not see a stale graph"
    assert Server(cache, prefill, decode).run() == generated  # stale: the old weights' tokens
    prefill.recapture()
    decode.recapture()
    assert Server(cache, prefill, decode).run() == fresh
    replays = prefill.backend.replays, decode.backend.replays
    prefill.release()
    decode.release()
    assert not prefill.graphs and not decode.graphs
    assert Server(cache, prefill, decode).run() == fresh
    assert (prefill.backend.replays, decode.backend.replays) == replays  # eager: no graph ran


def test_the_docs_example_runs():
    page = (Path(__file__).resolve().parent.parent / "docs" / "transformers.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```$", page, re.S | re.M) if "HFPrefillAdapter(" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/transformers.md", "exec"), {})


def test_prefill_logits_match_transformers_own_forward(model):
    """The prefill adapter's eager forward (what the graphs are compared with) against
    transformers running the same packed step over the paged cache."""
    from graphslot.integrations.transformers.batches import Packed, packed_logits

    ours, theirs = new_cache(model), new_cache(model)
    adapter = HFPrefillAdapter(model, ours)
    for cache in (ours, theirs):
        for _ in range(2):
            cache.alloc_request()
    prompts = PROMPTS[1], PROMPTS[4]
    chunks = [(row, 0, p, ours.alloc_tokens(row, 0, len(p))) for row, p in zip((1, 2), prompts)]
    got = adapter.forward_eager(prefill_step(ours.device, chunks))
    want = packed_logits(model, theirs, [Packed(p, 0, theirs.alloc_tokens(row, 0, len(p)))
                                         for row, p in zip((1, 2), prompts)])
    assert close(got[[len(prompts[0]) - 1, -1]], want)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_routing_changes_no_eager_output(impl):
    plain, routed = tiny_model("llama", attn_implementation=impl), tiny_model("llama", attn_implementation=impl)
    route_attention(routed)
    assert routed.config._attn_implementation == impl  # the model's own config is left as it was
    assert {m.config._attn_implementation for m in routed.modules() if hasattr(m, "num_key_value_groups")} == {
        f"graphslot_{impl}"}
    ids = torch.tensor([[0, 0, 3, 4], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits,
                           routed(input_ids=ids, attention_mask=mask).logits)


def test_a_family_the_prefill_stack_does_not_run_is_refused():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\): the prefill layer stack runs "
                                         r"Llama-like decoder layers only \(llama, mistral, qwen2, qwen3\)"):
        HFPrefillAdapter(model, new_cache(model))
    assert model.config._attn_implementation == "sdpa"  # left as it was
