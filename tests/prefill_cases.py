"""Prefill runner test cases shared by the capture-mode and CUDA tests."""

from __future__ import annotations

import random

import torch

from graphslot.graphs import SegmentedGraph
from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.numerics import output_check
from graphslot.reference.prefill_adapter import ReferencePrefillAdapter
from graphslot.runners.prefill import PrefillGraphRunner

BUCKETS = [16, 32, 64]


def make_prefill_runner(config=None, *, capture, adapter_cls=ReferencePrefillAdapter, runner_cls=PrefillGraphRunner,
                        device="cpu", **kwargs):
    """``(runtime, adapter, runner)`` for a fresh reference model; buckets :data:`BUCKETS`.
    The backend counts its graphs' replays (``runner.backend.replays``)."""
    rt = build_reference_model(config, device=device, max_num_reqs=64)
    adapter = adapter_cls(rt)
    kwargs.setdefault("progress", False)
    kwargs.setdefault("token_buckets", BUCKETS)
    return rt, adapter, runner_cls(adapter, capture=capture, **kwargs)


def mixed_batches(rt, seed=0, sizes=(1, 2, 3, 4, 5, 6, 7, 8), max_len=8):
    """Extend batches of 1..8 requests with mixed lengths; half of them continue the
    previous batch's requests after their cached prefix (chunked prefill)."""
    rng = random.Random(seed)
    for bs in sizes:
        rpi = rt.req_to_token_pool.alloc(bs)
        lens = [rng.randint(1, max_len) for _ in range(bs)]
        prompts = [[rng.randrange(1, 128) for _ in range(n)] for n in lens]
        yield make_extend_batch(rt, rpi, [0] * bs, prompts)
        if bs % 2 == 0:
            more = [[rng.randrange(1, 128) for _ in range(rng.randint(1, 4))] for _ in range(bs)]
            yield make_extend_batch(rt, rpi, lens, more)


def backend_graphs(graph):
    """How many backend graphs one replay of ``graph`` replays: its segments, or itself."""
    return graph.num_segments if isinstance(graph, SegmentedGraph) else 1


def run_replayed(runner, fb):
    """``runner(fb)``, checking that the backend itself counted a replay of every backend graph
    of the key ``fb`` runs (not the runner's word for it)."""
    before = runner.backend.replays
    out = runner(fb)
    graph = runner.graph(runner.bucket(fb), runner.request_slots(fb))
    assert runner.backend.replays - before == backend_graphs(graph), "the backend replayed no graph for this step"
    return out


def against_eager(rt, runner, batches):
    """Runner first, then eager (both write identical K/V); the buckets used. Bit-exact
    on the CPU tape where the matmul is batch-invariant (reference/numerics.py). Every
    step must replay a graph, as the backend counts."""
    check = output_check(rt.device)
    used = []
    for fb in batches:
        assert runner.can_run(fb)
        out = run_replayed(runner, fb).clone()
        eager = rt.forward(fb)
        assert out.shape == eager.shape == (fb.num_tokens, rt.config.vocab_size)
        assert check(out, eager), f"bs={fb.batch_size} tokens={fb.num_tokens} differs from eager ({check.name})"
        used.append((fb.num_tokens, runner.bucket(fb)))
    return used


def agreement_with_a_twin(rt, runner, seed=4, sizes=(2, 4, 6)):
    """Per batch, whether ``runner`` equals eager on a twin runtime (same weights, same
    slots), so a buggy runner's K/V cannot leak into the reference, and vice versa."""
    twin = build_reference_model(rt.config, max_num_reqs=64)
    return [torch.equal(runner(fb), twin.forward(twin_fb))
            for fb, twin_fb in zip(mixed_batches(rt, seed=seed, sizes=sizes, max_len=4),
                                   mixed_batches(twin, seed=seed, sizes=sizes, max_len=4))]


def replay_metadata_calls(rt, adapter, runner):
    """Run a few batches; ``(calls of init_replay_metadata, what they should have been)``."""
    calls = []
    original = adapter.init_replay_metadata
    adapter.init_replay_metadata = lambda n, view, fb: (calls.append((n, fb.batch_size)), original(n, view, fb))
    try:
        batches = list(mixed_batches(rt, seed=2, sizes=(3, 1, 3)))
        against_eager(rt, runner, batches)
    finally:
        del adapter.init_replay_metadata
    return calls, [(runner.bucket(fb), fb.batch_size) for fb in batches]


def assert_falls_back_to_eager(rt, runner):
    """More tokens than the largest bucket, more requests than ``max_bs``, or no prefill
    at all: the runner declines, and calling it runs eager."""
    per_request = runner.buckets[0] // 3 + 1
    rpi = rt.req_to_token_pool.alloc(3)
    big = make_extend_batch(rt, rpi, [0] * 3, [[5 + i] * per_request for i in range(3)])
    many = make_extend_batch(rt, rt.req_to_token_pool.alloc(runner.max_bs + 1), [0] * (runner.max_bs + 1),
                             [[1]] * (runner.max_bs + 1))
    for fb in (big, many):
        assert not runner.can_run(fb)
        assert torch.equal(runner(fb), rt.forward(fb))
    assert not runner.can_run(make_decode_batch(rt, rpi, [per_request] * 3, [1, 2, 3]))
