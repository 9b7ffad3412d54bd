"""gpu_proof part 2: the fill on sglang's real ``ForwardBatch``, kernels launched and host µs.

    python3 benchmarks/proof_fill.py --result PATH [--smoke]

Decode registries built by their factories with the arguments sglang's decode graph
runner passes (max_bs 256, benchmarks/bench_sglang_dropin.py's ``configs()``), on the
device: ``graphslot.integrations.sglang`` (the drop-in), and sglang 0.5.23's own
registry with ``SGLANG_OPT_CUDA_GRAPH_FILL_FAST_PATH`` off (its Triton ``small_copy``
across dtypes, else grouped ``_foreach_copy_``) and on (one ``_foreach_copy_`` when one
integer dtype pair, and no tail reset when nothing is padded). Per raw/padded size (3/4,
30/32, 200/256): host µs of ``fill_from`` + ``extract_buffer`` (median of 5 rounds, the
GPU keeping up), and the kernels one ``fill_from`` launches (``torch.profiler``: runtime
launch calls, GPU kernel/memcpy/memset events; CUDA only). Before timing, each
registry's fill is checked to leave the drop-in's buffers. Targets: the drop-in's
padded fill is one GPU event; at most 15 µs of host time at 200/256; cheaper than the
fast path at every size. sglang is loaded as the test suite loads it
(tests/sglang_loader.py), its Triton kernel from the installed wheel on CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import torch

from proof_common import Recorder, describe, piece_args, target_device

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import sglang_loader  # noqa: E402

FAST_PATH = "SGLANG_OPT_CUDA_GRAPH_FILL_FAST_PATH"
SIZES = ((3, 4), (30, 32), (200, 256))
TARGET_HOST_US = 15.0


def sglang_kernel() -> None:
    """sglang's ``small_copy`` (Triton; the registry imports it on CUDA) from the installed
    files: the loader stands in an empty ``sglang.kernels`` package."""
    name = "sglang.kernels.ops.memory.small_copy"
    if name in sys.modules:
        return
    path = Path(sys.modules["sglang"].__path__[0]) / "kernels" / "ops" / "memory" / "small_copy.py"
    package = types.ModuleType("sglang.kernels.ops.memory")
    package.__path__ = []
    sys.modules.setdefault(package.__name__, package)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def on_device(fb, device: torch.device):
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions",
                 "global_num_token_non_padded"):
        setattr(fb, name, getattr(fb, name).to(device))
    return fb


def variant(row: Dict[str, Any], name: str, registry, reference, fb, counts, fast: bool, iters: int, s) -> None:
    """One registry's figures at one size into ``row``, with sglang's fast path ``fast``
    (read by sglang at each fill, so set around every call)."""
    import bench_gpu_fastpath as fastpath
    import bench_sglang_dropin as dropin_bench

    sgl = sglang_loader.load()
    with sgl.registry.envs.SGLANG_OPT_CUDA_GRAPH_FILL_FAST_PATH.override(fast):
        step = dropin_bench.Stepper(registry, counts)
        if name != "graphslot":
            row[f"{name}_same_buffers"] = dropin_bench.same_step(registry, reference, fb, counts)

        def both() -> None:
            step.fill_from(fb)
            step.extract(fb)

        row[f"{name}_us"] = fastpath.host_us(both, iters, s)
        row[f"{name}_launches"] = fastpath.cuda_launches(lambda: step.fill_from(fb), s)


def measure(rec: Recorder, sgl, device: torch.device, smoke: bool) -> None:
    """Every size, every registry; a registry that fails (sglang's Triton kernel, say) is
    recorded under ``errors`` and the others are still measured."""
    import bench_sglang_dropin as dropin_bench
    import graphslot.integrations.sglang as dropin

    s = SimpleNamespace(cuda=device.type == "cuda")
    config = dropin_bench.configs()["decode"]
    config = dict(config, kwargs=dict(config["kwargs"], device=device))
    registries = {"graphslot": dropin_bench.build(dropin, config), "sglang": dropin_bench.build(sgl.registry, config)}
    variants = (("graphslot", "graphslot", False), ("sglang", "sglang", False), ("sglang_fast_path", "sglang", True))
    iters = 20 if smoke else 2000
    for raw, padded in SIZES:
        counts = (raw, padded, raw, padded)
        fb = on_device(dropin_bench.batch(sgl, "decode", raw, raw), device)
        row: Dict[str, Any] = {"raw": raw, "padded": padded}
        for name, reg, fast in variants:
            row.update({f"{name}_us": None, f"{name}_launches": None})
            rec.attempt(f"{name} {raw}/{padded}", functools.partial(
                variant, row, name, registries[reg], registries["graphslot"], fb, counts, fast, iters, s))
        ours = row["graphslot_us"]
        fast = row["sglang_fast_path_us"]
        row["vs_fast_path"] = None if ours is None or fast is None else fast / ours
        rec["rows"].append(row)
        rec.save()
    rows = rec["rows"]
    launches = [r["graphslot_launches"] for r in rows]
    ratios = [r["vs_fast_path"] for r in rows]
    at_256 = rows[-1]["graphslot_us"]
    rec["targets"] = {
        "one_gpu_event_per_padded_fill": None if None in launches else all(n["gpu_events"] == 1 for n in launches),
        "host_us_at_256": at_256, "host_us_target": TARGET_HOST_US,
        "host_us_met": None if at_256 is None else at_256 <= TARGET_HOST_US,
        "faster_than_fast_path_everywhere": None if None in ratios else all(r > 1 for r in ratios),
        "same_buffers_everywhere": all(r[k] for r in rows for k in r if k.endswith("_same_buffers")),
    }


def main(argv=None) -> int:
    args = piece_args(__doc__.splitlines()[0], argv)
    device = target_device(args.smoke)
    rec = Recorder(args.result, **describe(device), rows=[])
    try:
        sgl = sglang_loader.load()
    except ImportError as exc:
        rec["sglang"] = None
        rec["skipped"] = f"sglang missing: {exc} (carry the wheels of docs/benchmarks.md, 'GPU proof')"
        print(f"proof_fill: {rec['skipped']}", file=sys.stderr)
        return 0
    rec["sglang"] = sgl.version
    if device.type == "cuda":  # without it, sglang's own path fails at each fill, recorded there
        rec.attempt("sglang small_copy kernel", sglang_kernel)
    with sglang_loader.parallel(attn_tp_rank=0, attn_tp_size=1):
        measure(rec, sgl, device, args.smoke)
    return 1 if rec["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
