"""fill_from + extract_buffer per step: graphslot.integrations.sglang vs sglang 0.5.23's registry.

    python benchmarks/bench_sglang_dropin.py [--smoke] [--json PATH]

Both registries are built by their own factories with the arguments sglang's runners
pass (decode graph runner, prefill graph runner, eager runner) and stepped through the
same real sglang ``ForwardBatch`` objects with the same counts, through sglang's API
(``fill_from(fb, raw_bs=..., ...)``, ``extract_buffer(...)``), taking turns within each
repeat (median of the repeats). Before timing, one step of each is checked to leave
identical buffers, so both do the same work. Also measured: building a registry with
the factory (after the first build in the process) and, for the drop-in, building it
and binding it at its first fill. Needs sglang installed (``pip install --no-deps
sglang==0.5.23 msgspec``); it is loaded as the test suite loads it
(``tests/sglang_loader.py``).

Targets: the drop-in's step at least 4x cheaper than sglang's at every size, and a
registry built and bound in at most 5 ms after the first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import sglang_loader  # noqa: E402

from graphslot.cli.fill_bench import time_per_call  # noqa: E402
import graphslot.integrations.sglang as dropin  # noqa: E402

TARGET_RATIO = 4.0
TARGET_BUILD_MS = 5.0
CPU = torch.device("cpu")


def configs() -> Dict[str, Dict[str, Any]]:
    """The factories' arguments per runner (sglang's runners pass these), and the step
    sizes: (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)."""
    decode_steps = [(1, 1, 1, 1), (3, 4, 3, 4), (30, 32, 30, 32), (200, 256, 200, 256)]
    decode = dict(device=CPU, max_bs=256, max_num_token=256, seq_len_fill_value=1, cache_loc_dtype=torch.int64,
                  share_pool=False)
    return {
        # the decode graph runner of a single-rank deployment
        "decode": dict(factory="build_decode_registry", kwargs=decode, steps=decode_steps),
        # with expert or data parallelism: the non-padded count is computed every step
        "decode-ep": dict(factory="build_decode_registry", kwargs=dict(decode, enable_num_token_non_padded=True),
                          steps=decode_steps),
        "prefill": dict(factory="build_prefill_registry", kwargs=dict(
            device=CPU, max_bs=16, max_num_token=4096, cache_loc_dtype=torch.int64,
            enable_num_token_non_padded=True, share_pool=False),
            steps=[(2, 2, 100, 128), (4, 4, 1000, 1024), (16, 16, 3000, 4096)]),
        "eager": dict(factory="build_eager_registry", kwargs=dict(
            device=CPU, max_bs=256, max_num_token=4096, cache_loc_dtype=torch.int64),
            steps=[(3, 3, 3, 3), (200, 200, 200, 200), (8, 8, 2000, 2000)]),
    }


def batch(sgl, kind: str, raw_bs: int, raw_n: int):
    """A real sglang ForwardBatch carrying every field the registries read."""
    fbi = sgl.fbi
    g = torch.Generator().manual_seed(raw_bs * 7919 + raw_n)

    def ints(n, high=1000, dtype=torch.int64):
        return torch.randint(1, high, (n,), generator=g, dtype=dtype)

    seq_lens = ints(raw_bs)
    fb = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.DECODE if kind == "decode" else fbi.ForwardMode.EXTEND,
                          batch_size=raw_bs, input_ids=ints(raw_n, 32000), req_pool_indices=ints(raw_bs, 64),
                          seq_lens=seq_lens, out_cache_loc=ints(raw_n, 1 << 20), seq_lens_sum=int(seq_lens.sum()),
                          positions=ints(raw_n))
    fb.seq_lens_cpu = seq_lens.clone()
    fb.global_num_token_non_padded = torch.tensor([raw_n], dtype=torch.int32)
    fb.global_num_token_non_padded_cpu = raw_n
    return fb


class Stepper:
    """One step through sglang's API, with the counts fixed (the counts ``time_per_call``
    passes are ignored)."""

    def __init__(self, registry, counts):
        raw_bs, padded_bs, raw_n, padded_n = counts
        self.registry = registry
        self.fill_kw = dict(raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_n, padded_num_tokens=padded_n)
        self.view_kw = dict(padded_bs=padded_bs, padded_num_tokens=padded_n)

    def fill_from(self, fb, **_):
        self.registry.fill_from(fb, **self.fill_kw)

    def extract(self, fb, **_):
        return self.registry.extract_buffer(forward_batch_template=fb, **self.view_kw)


def build(module, config) -> Any:
    kwargs = config["kwargs"]
    if config["factory"] == "build_eager_registry":  # pooled: a fresh pool keeps them apart
        sglang_loader.load().input_buffers._forward_input_buffer_pool.clear()
    return getattr(module, config["factory"])(**kwargs)


def same_step(sgl_reg, ours, fb, counts) -> bool:
    for reg in (sgl_reg, ours):
        for name in reg.slot_names():
            reg.get_slot(name).buffer.zero_()
        Stepper(reg, counts).fill_from(fb)
    return sgl_reg.slot_names() == ours.slot_names() and all(
        torch.equal(sgl_reg.get_slot(n).buffer, ours.get_slot(n).buffer) for n in sgl_reg.slot_names())


def median_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(iters: int, repeats: int, builds: int) -> Dict[str, Any]:
    sgl = sglang_loader.load()
    with sglang_loader.parallel(attn_tp_rank=0, attn_tp_size=1):
        return _run(sgl, iters, repeats, builds)


def _run(sgl, iters: int, repeats: int, builds: int) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    construction = []
    for kind, config in configs().items():
        sgl_reg, ours = build(sgl.registry, config), build(dropin, config)
        for counts in config["steps"]:
            fb = batch(sgl, kind, counts[0], counts[2])
            if not same_step(sgl_reg, ours, fb, counts):
                raise SystemExit(f"{kind} {counts}: the two registries disagree; the benchmark would compare "
                                 "different work")
            us = time_per_call({"sglang": Stepper(sgl_reg, counts), "dropin": Stepper(ours, counts)}, fb,
                               counts[0], counts[1], iters, repeats)
            rows.append({"runner": kind, "raw_bs": counts[0], "padded_bs": counts[1], "raw_num_tokens": counts[2],
                         "padded_num_tokens": counts[3], "sglang_us": us["sglang"], "dropin_us": us["dropin"],
                         "ratio": us["sglang"] / us["dropin"]})
        counts = config["steps"][0]
        fb = batch(sgl, kind, counts[0], counts[2])

        def build_and_bind():
            Stepper(build(dropin, config), counts).fill_from(fb)

        construction.append({"runner": kind, "sglang_ms": median_ms(lambda: build(sgl.registry, config), builds),
                             "dropin_ms": median_ms(lambda: build(dropin, config), builds),
                             "dropin_with_bind_ms": median_ms(build_and_bind, builds)})
    sgl.input_buffers._forward_input_buffer_pool.clear()
    met = (all(r["ratio"] >= TARGET_RATIO for r in rows)
           and all(c["dropin_with_bind_ms"] <= TARGET_BUILD_MS for c in construction))
    return {"sglang": sgl.version, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "iters": iters, "repeats": repeats,
            "rows": rows, "construction": construction,
            "targets": {"ratio": TARGET_RATIO, "build_ms": TARGET_BUILD_MS}, "targets_met": met}


def report(result: Dict[str, Any]) -> str:
    lines = [f"fill_from + extract_buffer per step, CPU, sglang {result['sglang']}, torch {result['torch']}, "
             f"{result['threads']} threads (median of {result['repeats']} x {result['iters']} steps)",
             f"{'runner':<10} {'bs raw/pad':>10} {'tokens raw/pad':>15} {'sglang':>10} {'drop-in':>10} {'ratio':>7}"]
    for r in result["rows"]:
        lines.append(f"{r['runner']:<10} {r['raw_bs']:>4}/{r['padded_bs']:<5} {r['raw_num_tokens']:>7}/"
                     f"{r['padded_num_tokens']:<7} {r['sglang_us']:>8.1f}µs {r['dropin_us']:>8.1f}µs "
                     f"{r['ratio']:>6.1f}x")
    lines.append("registry construction (median, after the first build in the process)")
    for c in result["construction"]:
        lines.append(f"{c['runner']:<10} sglang {c['sglang_ms']:.2f} ms, drop-in {c['dropin_ms']:.2f} ms, "
                     f"drop-in built and bound at its first fill {c['dropin_with_bind_ms']:.2f} ms")
    t = result["targets"]
    lines.append(f"targets: drop-in >= {t['ratio']}x cheaper per step at every size, built and bound in <= "
                 f"{t['build_ms']} ms: {'met' if result['targets_met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few steps only (checks the script runs)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    iters, repeats, builds = (20, 2, 3) if args.smoke else (1000, 7, 30)
    result = run(iters, repeats, builds)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
