"""Prefill runner test cases shared by the breakable, piecewise and CUDA tests."""

from __future__ import annotations

import random

from graphslot.reference import build_reference_model, make_extend_batch
from graphslot.reference.numerics import output_check

BUCKETS = [16, 32, 64]


def make_prefill_runner(config=None, *, runner_cls, adapter_cls, device="cpu", **kwargs):
    """``(runtime, adapter, runner)`` for a fresh reference model; buckets :data:`BUCKETS`."""
    rt = build_reference_model(config, device=device, max_num_reqs=64)
    adapter = adapter_cls(rt)
    kwargs.setdefault("progress", False)
    kwargs.setdefault("token_buckets", BUCKETS)
    return rt, adapter, runner_cls(adapter, **kwargs)


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


def against_eager(rt, runner, batches):
    """Runner first, then eager (both write identical K/V); the buckets used. Bit-exact
    on the CPU tape where the matmul is batch-invariant (reference/numerics.py)."""
    check = output_check(rt.device)
    used = []
    for fb in batches:
        assert runner.can_run(fb)
        out = runner(fb).clone()
        eager = rt.forward(fb)
        assert out.shape == eager.shape == (fb.num_tokens, rt.config.vocab_size)
        assert check(out, eager), f"bs={fb.batch_size} tokens={fb.num_tokens} differs from eager ({check.name})"
        used.append((fb.num_tokens, runner.bucket(fb)))
    return used
