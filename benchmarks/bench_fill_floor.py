"""Generated fill_from + extract against the floor, for N slots (8 to 512).

The floor is what any Python implementation of a step must do: read the N batch
fields, issue one ``torch._foreach_copy_`` of pre-sliced heads and padded tails, and
make a shallow copy of the batch with the N views set. Everything else the generated
code does (its checks, its plan lookup) is measured as the ratio to it.

    python benchmarks/bench_fill_floor.py [--slots 8 32 128 512] [--repeat 7] [--calls 2000]

Prints, per N: the floor and generated microseconds per step (median of the repeats,
interleaved) and their ratio; the target is a ratio of at most 1.3 at every N. Times
are the thread's CPU time (``time.thread_time``), so other work on a shared machine
does not count.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from types import SimpleNamespace

import torch

import graphslot as gs


DTYPES = ("int64", "int32", "float32")


def spec_of(n: int) -> gs.RegistrySpec:
    """N slots: by batch size and by tokens, three dtypes, every fifth one 2-D, padded
    with zero or a sentinel."""
    slots = [{"name": f"f{i}", "shape": ["max_bs" if i % 2 else "max_num_tokens"] + ([4] if i % 5 == 0 else []),
              "dtype": DTYPES[i % 3], "axis": "bs" if i % 2 else "tokens",
              **({"padding": "fill_sentinel", "pad_value": 1} if i % 3 == 0 else {"padding": "zero"})}
             for i in range(n)]
    return gs.spec_from_dict({"name": f"bench{n}", "slots": slots})


def batch_of(reg, bs: int, tokens: int) -> SimpleNamespace:
    """A batch of ``bs`` requests and ``tokens`` tokens for every slot of ``reg``."""
    fields = {}
    for slot in reg.active:
        shape = list(slot.buffer.shape)
        shape[0] = bs if slot.resolved.axis.value == "bs" else tokens
        fields[slot.name] = torch.ones(shape, dtype=slot.buffer.dtype)
    return SimpleNamespace(batch_size=bs, **fields)


def floor_step(reg, raw_bs: int, padded_bs: int, raw_t: int, padded_t: int):
    """The floor: a plan made once; per step the fields read, one foreach copy of
    heads and tails, one shallow copy with the views set."""
    names = [s.name for s in reg.active]
    by_bs = [s.resolved.axis.value == "bs" for s in reg.active]
    bufs = [s.buffer for s in reg.active]
    raw = [raw_bs if b else raw_t for b in by_bs]
    padded = [padded_bs if b else padded_t for b in by_bs]
    heads = [b[:r] for b, r in zip(bufs, raw)]
    tails = [b[r:p] for b, r, p in zip(bufs, raw, padded)]
    pads = [torch.zeros_like(t) for t in tails]
    views = [b[:p] for b, p in zip(bufs, padded)]

    def step(fb):
        srcs = [getattr(fb, name) for name in names]
        torch._foreach_copy_(heads + tails, srcs + pads)
        view = copy.copy(fb)
        view.__dict__.update(zip(names, views))
        view.batch_size = padded_bs
        return view

    return step


def per_call(fn, fb, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn(fb)
    return (time.thread_time() - start) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    raw_bs, padded_bs, raw_t, padded_t = 3, 4, 3, 4
    print(f"{'slots':>6} {'floor us':>9} {'generated us':>13} {'ratio':>6}")
    worst = 0.0
    for n in args.slots:
        reg = gs.build_registry(spec_of(n), max_bs=8, max_num_tokens=8, device="cpu")
        fb = batch_of(reg, raw_bs, raw_t)
        floor = floor_step(reg, raw_bs, padded_bs, raw_t, padded_t)

        def generated(fb):
            reg.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_t, padded_num_tokens=padded_t)
            return reg.extract(fb, padded_bs=padded_bs, padded_num_tokens=padded_t)

        calls = max(50, args.calls * 8 // n)
        for fn in (floor, generated):
            per_call(fn, fb, calls // 4)  # warm
        a, b = [], []
        for _ in range(args.repeat):
            a.append(per_call(floor, fb, calls))
            b.append(per_call(generated, fb, calls))
        fa, fg = statistics.median(a), statistics.median(b)
        worst = max(worst, fg / fa)
        print(f"{n:>6} {fa:>9.1f} {fg:>13.1f} {fg / fa:>6.2f}")
    print(f"worst ratio {worst:.2f} (target <= 1.30)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
