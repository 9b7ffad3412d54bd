"""gpu_proof part 3: capture economics per capture mode, and the step gap.

    python3 benchmarks/proof_capture.py --result PATH --what full|breakable|piecewise|gap[,...] [--smoke]

``--what MODE``: the reference model at Llama-3.2-1B's shape (bf16, random weights;
benchmarks/bench_gpu_fastpath.py's ``CONFIG_1B``) and a ``DecodeGraphRunner`` capturing
every default decode size up to 256 (35 sizes; smoke: tiny fp32 model, 4 sizes on the
CPU tape) with ``capture=MODE``, in a process of its own (a clean allocator): seconds,
``memory_allocated``/``memory_reserved`` growth, the graphs' pool, and Dynamo's trace
counts (``torch._dynamo.utils.counters``: frames compiled and unique graphs; piecewise
traces once per size, the others not at all). Targets: at most 5 s and 1 GiB reserved.

``--what gap``: bench_gpu_fastpath's steady decode loop at bs 1, 32 and 256: the GPU time
per step not spent in the graph (idle, and the fill's and metadata's kernels) and the
host µs around the replay. Target: at most 50 µs at 256.
"""

from __future__ import annotations

import sys
import time

import torch

from proof_common import Recorder, describe, grown, memory, piece_args, target_device

TARGET_S = 5.0
TARGET_RESERVED = 1 << 30
TARGET_GAP_US = 50.0


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"frames_ok": counters["frames"]["ok"], "frames_total": counters["frames"]["total"],
            "unique_graphs": counters["stats"]["unique_graphs"]}


class Marks(list):
    """The metered adapter's per-size marks, reporting each new one."""

    def __init__(self, on_mark):
        super().__init__()
        self.on_mark = on_mark

    def append(self, mark) -> None:
        super().append(mark)
        self.on_mark(len(self))


def capture(rec: Recorder, s, mode: str) -> None:
    import bench_gpu_fastpath as fastpath
    from graphslot.reference import build_reference_model
    from graphslot.runners.decode import DecodeGraphRunner

    rt = build_reference_model(s.config, s.device, s.dtype, max_num_reqs=s.max_bs)
    traces = dynamo_counts()
    before = memory(s.device)
    start = time.perf_counter()

    def progress(started: int) -> None:  # a capture cut at the deadline still says how far it got
        now = dynamo_counts()
        rec[mode] = {"partial": True, "sizes_started": started, "seconds_so_far": time.perf_counter() - start,
                     "dynamo": {k: now[k] - traces[k] for k in now}}

    marks = Marks(progress)
    runner = DecodeGraphRunner(fastpath.MeteredAdapter(rt, marks), max_bs=s.max_bs, capture=mode, progress=False)
    seconds = time.perf_counter() - start
    total = grown(before, memory(s.device))
    after = dynamo_counts()
    rec[mode] = {
        "sizes": len(runner.captured_sizes), "capture_s": runner.capture_seconds,
        "construct_s": seconds, "memory": total, "pool": fastpath.pool_segments(runner.backend),
        "outputs_held": fastpath.outputs_held(runner),
        "dynamo": {k: after[k] - traces[k] for k in after},
        "targets": {"seconds": TARGET_S, "reserved": TARGET_RESERVED,
                    "seconds_met": runner.capture_seconds <= TARGET_S,
                    "reserved_met": None if total["reserved"] is None else total["reserved"] <= TARGET_RESERVED},
    }


def gap(rec: Recorder, s) -> None:
    import bench_gpu_fastpath as fastpath
    from graphslot.reference import build_reference_model

    rt = build_reference_model(s.config, s.device, s.dtype, max_num_reqs=s.max_bs)
    rows = fastpath.bench_gap(s, rt)
    largest = rows[-1]
    rec["gap"] = {"rows": rows, "targets": {
        "gap_us": TARGET_GAP_US, "bs": largest["bs"],
        "gap_met": None if largest["gap_us"] is None else largest["gap_us"] <= TARGET_GAP_US}}


def main(argv=None) -> int:
    args = piece_args(__doc__.splitlines()[0], argv)
    import bench_gpu_fastpath as fastpath

    device = target_device(args.smoke)
    s = fastpath.setup(args.smoke)
    rec = Recorder(args.result, **describe(device),
                   model=f"hidden {s.config.hidden_size}, {s.config.num_layers} layers, "
                         f"{str(s.dtype).replace('torch.', '')}")
    torch.manual_seed(0)
    for what in args.what.split(","):  # one process each on a GPU (a clean allocator); all in one for --smoke
        rec.attempt(what, lambda what=what: gap(rec, s) if what == "gap" else capture(rec, s, what))
    return 1 if rec["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
