"""``graphslot bench``: generated vs interpreted vs hand-written fill_from + extract.

Everything is measured in one run on this machine: per-call time of ``fill_from`` +
``extract`` for the shipped decode spec (graphslot's own file, :data:`SPEC`, whatever a
project in the working directory calls ``decode``: the hand-written baseline and the op
targets are that spec's) at a few (raw, padded) batch sizes, and the
number of mutating ATen ops one padded fill issues (on a GPU each is a kernel launch).
The generated column includes the contract's per-step check (one shape comparison per
copied field); the "checks" column is what that costs, measured against the same
module with the check removed (the difference of two noisy medians, shown as 0 when
noise makes it negative; ``unchecked_us`` is the raw figure).

Targets: the op counts are deterministic and gate (``gating_missed``); the speedup over
the interpreter is a timing, which a loaded machine moves, so a miss is reported with
its margin (:func:`missed_targets`) but does not fail the run.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
import types
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Set

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import __version__
from ..api import build_registry
from ..codegen.generator import render_module
from ..log import progress_bar
from ..spec.files import display_path
from ..spec.loading import load_spec, shipped_spec_path
from ..spec.resolve import resolve_params

SIZES = ((3, 4), (30, 32), (200, 256))
MAX_BS = 256
TARGET_SPEEDUP = 5.0
TARGET_OPS = 2  # one grouped copy on the device, one on the host (seq_lens_cpu)
TARGET_DEVICE_OPS = 1
#: The spec measured: the shipped decode spec's file.
SPEC = shipped_spec_path("decode")


def decode_batch(n: int, device: str = "cpu") -> SimpleNamespace:
    """A decode batch of ``n`` requests with the fields the decode spec mirrors."""
    ar = torch.arange(n, device=device)
    return SimpleNamespace(batch_size=n, input_ids=ar + 10, positions=ar + 3, out_cache_loc=ar + 7,
                           req_pool_indices=ar + 1, seq_lens=ar + 4, seq_lens_cpu=(ar + 4).cpu(),
                           mrope_positions=None)


class HandWrittenDecode:
    """What an engine writes by hand for the same slots (sglang's legacy
    populate_from_forward_batch style): per-field slicing, fills and a grouped copy."""

    def __init__(self, max_bs: int, max_num_tokens: int, device: str = "cpu", seq_len_fill_value: int = 1):
        def z(n, **kw):
            return torch.zeros(n, dtype=torch.int64, device=device, **kw)

        self.fill_value = seq_len_fill_value
        self.input_ids = z(max_num_tokens)
        self.positions = z(max_num_tokens)
        self.out_cache_loc = z(max_num_tokens)
        self.req_pool_indices = z(max_bs)
        self.seq_lens = z(max_bs).fill_(seq_len_fill_value)
        self.seq_lens_cpu = torch.full((max_bs,), seq_len_fill_value, dtype=torch.int64)
        self.mrope_positions = torch.zeros(3, max_num_tokens, dtype=torch.int64, device=device)
        self.global_num_tokens_gpu = torch.zeros(1, dtype=torch.int32, device=device)
        self.global_num_tokens_for_logprob_gpu = torch.zeros(1, dtype=torch.int32, device=device)

    def fill_from(self, fb, *, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, side_inputs=None):
        if raw_bs < padded_bs:
            self.req_pool_indices[raw_bs:padded_bs].zero_()
            self.seq_lens[raw_bs:padded_bs].fill_(self.fill_value)
            self.seq_lens_cpu[raw_bs:padded_bs].fill_(self.fill_value)
        if raw_num_tokens < padded_num_tokens:
            self.positions[raw_num_tokens:padded_num_tokens].zero_()
            self.out_cache_loc[raw_num_tokens:padded_num_tokens].zero_()
            self.mrope_positions[:, raw_num_tokens:padded_num_tokens].zero_()
        torch._foreach_copy_(
            [self.input_ids[:raw_num_tokens], self.positions[:raw_num_tokens], self.out_cache_loc[:raw_num_tokens],
             self.req_pool_indices[:raw_bs], self.seq_lens[:raw_bs]],
            [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens])
        self.seq_lens_cpu[:raw_bs].copy_(fb.seq_lens_cpu)
        if fb.mrope_positions is not None:
            self.mrope_positions[:, :raw_num_tokens].copy_(fb.mrope_positions)

    def extract(self, fb, *, padded_bs, padded_num_tokens):
        view = SimpleNamespace(**vars(fb))
        view.batch_size = padded_bs
        view.input_ids = self.input_ids[:padded_num_tokens]
        view.positions = self.positions[:padded_num_tokens]
        view.out_cache_loc = self.out_cache_loc[:padded_num_tokens]
        view.req_pool_indices = self.req_pool_indices[:padded_bs]
        view.seq_lens = self.seq_lens[:padded_bs]
        view.seq_lens_cpu = self.seq_lens_cpu[:padded_bs]
        if fb.mrope_positions is not None:
            view.mrope_positions = self.mrope_positions[:, :padded_num_tokens]
        view.global_num_tokens_gpu = self.global_num_tokens_gpu
        view.global_num_tokens_for_logprob_gpu = self.global_num_tokens_for_logprob_gpu
        return view


def _written(func, args, kwargs) -> List[torch.Tensor]:
    """The tensors an ATen op writes (its schema's mutable arguments, lists flattened)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
            out += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
    return out


class MutatingOpCounter(TorchDispatchMode):
    """Counts ATen ops that write into a tensor argument (in-place or out=); with
    ``storages`` (data pointers of untyped storages), only ops writing into one of them."""

    def __init__(self, storages: Optional[Set[int]] = None):
        super().__init__()
        self.ops: List[str] = []
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and (self.storages is None or any(
                t.untyped_storage().data_ptr() in self.storages for t in _written(func, args, kwargs))):
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def count_mutating_ops(fill: Callable, fb, raw: int, padded: int) -> List[str]:
    with MutatingOpCounter() as counter:
        fill(fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw, padded_num_tokens=padded)
    return counter.ops


def device_storages(registry) -> Set[int]:
    """Storages of a registry's device buffers (not its ``device: cpu`` slots): on a GPU,
    every op writing one of them is a kernel launch."""
    return {s.buffer.untyped_storage().data_ptr() for s in registry.active if not s.resolved.host}


def count_device_ops(registry, fb, raw_bs: int, padded_bs: int, raw_num_tokens: int, padded_num_tokens: int,
                     side_inputs=None) -> List[str]:
    """The ops one ``fill_from`` issues that write the registry's device buffers."""
    with MutatingOpCounter(device_storages(registry)) as counter:
        registry.fill_from(fb, raw_bs=raw_bs, padded_bs=padded_bs, raw_num_tokens=raw_num_tokens,
                           padded_num_tokens=padded_num_tokens, side_inputs=side_inputs)
    return counter.ops


def time_per_call(runners: Dict[str, object], fb, raw: int, padded: int, iters: int = 2000,
                  repeats: int = 7, tick: Callable[[], object] = lambda: None) -> Dict[str, float]:
    """Median over ``repeats`` of the mean µs of one fill_from + extract, per runner; the
    runners take turns within each repeat, so drift in the machine's speed hits all alike.
    ``tick()`` is called after each repeat."""
    for r in runners.values():
        for _ in range(200):
            r.fill_from(fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw, padded_num_tokens=padded)
            r.extract(fb, padded_bs=padded, padded_num_tokens=padded)
    samples: Dict[str, List[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            fill = r.fill_from
            extract = r.extract
            start = time.perf_counter()
            for _ in range(iters):
                fill(fb, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw, padded_num_tokens=padded)
                extract(fb, padded_bs=padded, padded_num_tokens=padded)
            samples[name].append((time.perf_counter() - start) / iters * 1e6)
        tick()
    return {name: statistics.median(values) for name, values in samples.items()}


def unchecked_decode_module() -> types.ModuleType:
    """The generated decode module without its per-step shape check (measurement only:
    what the check costs)."""
    spec = load_spec(SPEC)
    lines = render_module(spec, resolve_params(spec)).splitlines()
    kept = []
    skipping = False
    for line in lines:
        skipping = skipping or line.strip().startswith("if (src_")
        if not skipping:
            kept.append(line)
        skipping = skipping and not line.strip().startswith("raise __gs_Mismatch")
    module = types.ModuleType("graphslot_bench_unchecked")
    exec(compile("\n".join(kept), "<graphslot-bench unchecked decode>", "exec"), module.__dict__)
    return module


def run_bench(iters: int = 2000, repeats: int = 7, device: str = "cpu", progress: bool = False) -> Dict:
    """Every figure of the report; ``progress``: a bar on stderr when it is a terminal,
    else a line per size."""
    runners = {
        "generated": build_registry(SPEC, max_bs=MAX_BS, max_num_tokens=MAX_BS, device=device, impl="generated"),
        "unchecked": build_registry(SPEC, max_bs=MAX_BS, max_num_tokens=MAX_BS, device=device,
                                    impl=unchecked_decode_module()),
        "interpreted": build_registry(SPEC, max_bs=MAX_BS, max_num_tokens=MAX_BS, device=device, impl="interpreted"),
        "hand_written": HandWrittenDecode(MAX_BS, MAX_BS, device=device),
    }
    rows = []
    bar = progress_bar(show=progress, total=len(SIZES) * repeats, desc="Timing", unit="sample", leave=False)
    for i, (raw, padded) in enumerate(SIZES, 1):
        fb = decode_batch(raw, device)
        row = {"raw": raw, "padded": padded}
        for name, us in time_per_call(runners, fb, raw, padded, iters, repeats, bar.update).items():
            row[f"{name}_us"] = us
            row[f"{name}_ops"] = len(count_mutating_ops(runners[name].fill_from, fb, raw, padded))
        reg = runners["generated"]
        row["generated_device_ops"] = len(count_device_ops(reg, fb, raw, padded, raw, padded))
        row["check_us"] = max(0.0, row["generated_us"] - row["unchecked_us"])  # two noisy medians: never < 0
        del row["unchecked_ops"]
        row["speedup_vs_interpreted"] = row["interpreted_us"] / row["generated_us"]
        row["speedup_vs_hand_written"] = row["hand_written_us"] / row["generated_us"]
        rows.append(row)
        if progress and bar.disable:  # no terminal for a bar: a line per size
            print(f"graphslot bench: raw/padded {raw}/{padded} timed ({i} of {len(SIZES)})", file=sys.stderr)
    bar.close()
    missed = missed_targets(rows)
    return {"spec": display_path(SPEC), "device": device, "torch": torch.__version__, "graphslot": __version__,
            "python": platform.python_version(), "platform": platform.platform(), "threads": torch.get_num_threads(),
            "max_bs": MAX_BS, "iters": iters, "repeats": repeats, "rows": rows,
            "targets": {"speedup_vs_interpreted": TARGET_SPEEDUP, "max_ops": TARGET_OPS,
                        "max_device_ops": TARGET_DEVICE_OPS}, "targets_met": not missed, "missed": missed,
            "gating_missed": any(m["gates"] for m in missed)}


def missed_targets(rows: List[Dict]) -> List[Dict]:
    """Every target a row misses: the size, the target, the figure, the limit, by how
    much (``margin``, > 0) and whether it ``gates`` (op counts do; the timing does not)."""
    missed = []
    for r in rows:
        size = f"{r['raw']}/{r['padded']}"
        if r["speedup_vs_interpreted"] < TARGET_SPEEDUP:
            missed.append({"size": size, "target": "speedup_vs_interpreted", "value": r["speedup_vs_interpreted"],
                           "limit": TARGET_SPEEDUP, "margin": TARGET_SPEEDUP - r["speedup_vs_interpreted"],
                           "gates": False})
        for target, key, limit in (("max_ops", "generated_ops", TARGET_OPS),
                                   ("max_device_ops", "generated_device_ops", TARGET_DEVICE_OPS)):
            if r[key] > limit:
                missed.append({"size": size, "target": target, "value": r[key], "limit": limit,
                               "margin": r[key] - limit, "gates": True})
    return missed


def describe_miss(miss: Dict) -> str:
    """One line: which target, at which size, the figure and the margin."""
    where = f"raw/padded {miss['size']}"
    if miss["target"] == "speedup_vs_interpreted":
        return (f"{where}: generated is {miss['value']:.2f}x the interpreter, target >= {miss['limit']}x, short by "
                f"{miss['margin']:.2f}x (a timing: reported, not gated)")
    what = "mutating ops per padded fill" if miss["target"] == "max_ops" else "ops on the device per padded fill"
    return f"{where}: {miss['value']} {what}, target <= {miss['limit']}, {miss['margin']} over"


def format_report(result: Dict) -> str:
    lines = [f"fill_from + extract, shipped decode spec ({result['spec']}), max_bs {result['max_bs']}, "
             f"device {result['device']}, "
             f"torch {result['torch']}",
             f"{'raw/padded':>10}  {'generated':>10}  {'interpreted':>11}  {'hand-written':>12}  "
             f"{'vs interp':>9}  {'vs hand':>7}  {'ops gen/int/hand':>16}  {'dev ops':>7}  {'checks':>8}"]
    for r in result["rows"]:
        lines.append(
            f"{r['raw']:>4}/{r['padded']:<5}  {r['generated_us']:>8.2f}µs  {r['interpreted_us']:>9.2f}µs  "
            f"{r['hand_written_us']:>10.2f}µs  {r['speedup_vs_interpreted']:>8.2f}x  "
            f"{r['speedup_vs_hand_written']:>6.2f}x  "
            f"{r['generated_ops']:>6}/{r['interpreted_ops']}/{r['hand_written_ops']}  {r['generated_device_ops']:>7}  "
            f"{r['check_us']:>6.2f}µs")
    t = result["targets"]
    lines.append(f"targets: generated >= {t['speedup_vs_interpreted']}x the interpreter at every size, "
                 f"<= {t['max_ops']} mutating ops per padded fill, <= {t['max_device_ops']} on the device: "
                 f"{'met' if result['targets_met'] else 'missed:'}")
    lines += [f"  {describe_miss(m)}" for m in result["missed"]]
    return "\n".join(lines)
