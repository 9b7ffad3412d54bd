"""Host microseconds per replayed decode step, per capture mode, before vs after issue 33.

*Before* is ``DecodeGraphRunner`` as it was at ``BEFORE`` (the commit this branch
started from): the whole package as of that commit (``git archive``) is imported in a
child process, its runner, reference model and tape together -- the old runner module
alone does not run over today's package (its config has changed). It had one capture
mode, ``full``. *After* is today's runner in each capture mode. Each runner gets its own
identical reference model (the tape backend, one thread), and the same cycle of decode
batches whose size changes every step (1..4 requests, 3 padded to 4).

Two figures per runner, the median over rounds (interleaved between today's runners; the
child measures its rounds first):

* ``host_us``: ``runner(fb)`` with every tape graph's replay and every eager step made a
  no-op: what a step costs the host on a GPU, where replay is a launch -- the dispatch,
  the fill, the metadata hook (the reference attention's, on the CPU) and the replay call
  itself (for a segmented graph, the walk over its steps). The figure the ratio and the
  "not slower" check are about;
* ``step_us``: ``runner(fb)`` as it is, the tape replaying the model on the CPU (the
  eager attention steps of breakable and piecewise graphs included).

``python benchmarks/bench_runner_step.py [--json] [--iters N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

import graphslot

from graphslot.graphs import EagerStep, TapeGraph
from graphslot.reference import build_reference_model, make_decode_batch, make_extend_batch
from graphslot.reference.adapter import ReferenceDecodeAdapter
from graphslot.runners import DecodeGraphRunner

ROOT = Path(__file__).resolve().parent.parent
#: The commit before issue 33's runners.
BEFORE = "7ca5a4a"
SIZES = (1, 3, 2, 4)
OPTIONS = {"max_bs": 4, "capture_bs": [1, 2, 4], "progress": False, "backend": "cpu"}


def measure_before(iters: int, rounds: int) -> Dict[str, List[float]]:
    """The samples of ``DecodeGraphRunner`` as of :data:`BEFORE`: this script run with
    ``--before-only`` in a child process that imports that commit's package."""
    with tempfile.TemporaryDirectory(prefix="graphslot-before-") as tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", BEFORE, "graphslot"],
                                 capture_output=True)
        if archive.returncode:
            raise SystemExit(f"bench_runner_step: cannot read the package as of {BEFORE} (a clone with that "
                             f"commit's history is needed): {archive.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
        env = {**os.environ, "PYTHONPATH": tree}
        child = subprocess.run([sys.executable, __file__, "--before-only", "--iters", str(iters),
                                "--rounds", str(rounds)], capture_output=True, text=True, cwd=tree, env=env)
    if child.returncode:
        raise SystemExit(f"bench_runner_step: the runner as of {BEFORE} failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout)


def this_package_is(tree: Path) -> None:
    """Refuse to measure a ``graphslot`` imported from elsewhere than ``tree``."""
    here = Path(graphslot.__file__).resolve().parent
    if here != tree.resolve() / "graphslot":
        raise SystemExit(f"bench_runner_step --before-only: imported graphslot from {here}, not from {tree}")


def batches(rt: Any) -> List[Any]:
    """One decode batch per size of :data:`SIZES`, over four prefilled requests."""
    rpi = rt.req_to_token_pool.alloc(4)
    rt.forward(make_extend_batch(rt, rpi, [0] * 4, [[i + 1, i + 2, i + 3] for i in range(4)]))
    return [make_decode_batch(rt, rpi[:bs], [3] * bs, [5] * bs) for bs in SIZES]


@contextlib.contextmanager
def launches_only():
    """Tape graphs and eager steps do nothing: what is left is the host's part of a step."""
    replay, call = TapeGraph.replay, EagerStep.__call__
    TapeGraph.replay = EagerStep.__call__ = lambda self: None
    try:
        yield
    finally:
        TapeGraph.replay, EagerStep.__call__ = replay, call


def per_step_us(runner: Callable, steps: List[Any], iters: int) -> float:
    start = time.perf_counter()
    for i in range(iters):
        runner(steps[i % len(steps)])
    return (time.perf_counter() - start) / iters * 1e6


def measure(cases: Dict[str, Any], iters: int, rounds: int) -> Dict[str, Dict[str, List[float]]]:
    """``host_us`` and ``step_us`` samples of each ``(runner, steps)`` of ``cases``."""
    samples: Dict[str, Dict[str, List[float]]] = {name: {"host_us": [], "step_us": []} for name in cases}
    for _ in range(rounds):  # interleaved, so drift hits every runner alike
        for name, (runner, steps) in cases.items():
            with launches_only():
                samples[name]["host_us"].append(per_step_us(runner, steps, iters))
            samples[name]["step_us"].append(per_step_us(runner, steps, max(iters // 10, 1)))
    for name, (runner, _) in cases.items():
        assert runner.metrics()["eager_fallbacks"] == 0, f"{name}: a step ran eager"
    return samples


def reference_case(make: Callable) -> Any:
    rt = build_reference_model(max_num_reqs=8)
    return make(ReferenceDecodeAdapter(rt)), batches(rt)


def run_before_only(iters: int, rounds: int) -> Dict[str, List[float]]:
    """In the child: the samples of the imported package's runner in its one mode."""
    this_package_is(Path.cwd())
    torch.set_num_threads(1)
    cases = {"full": reference_case(lambda a: DecodeGraphRunner(a, **OPTIONS))}
    return measure(cases, iters, rounds)["full"]


def run(iters: int = 400, rounds: int = 7) -> Dict[str, Any]:
    from graphslot.runners.capture import CAPTURE_MODES  # today's package only

    samples = {"full (before)": measure_before(iters, rounds)}
    torch.set_num_threads(1)
    cases = {mode: reference_case(lambda a, mode=mode: DecodeGraphRunner(a, capture=mode, **OPTIONS))
             for mode in CAPTURE_MODES}
    samples.update(measure(cases, iters, rounds))
    result: Dict[str, Any] = {"before": BEFORE, "sizes": list(SIZES), "torch": torch.__version__, "runners": {}}
    base = statistics.median(samples["full (before)"]["host_us"])
    for name, figures in samples.items():
        row = {k: statistics.median(v) for k, v in figures.items()}
        row["host_vs_full_before"] = row["host_us"] / base
        result["runners"][name] = row
    return result


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.before_only:
        print(json.dumps(run_before_only(args.iters, args.rounds)))
        return
    result = run(args.iters, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"decode step on the tape, batch sizes {result['sizes']} in turn (torch {result['torch']}, "
          f"before = {result['before']})")
    print(f"{'runner':<16}{'host µs':>10}{'vs full before':>16}{'step µs':>10}")
    for name, row in result["runners"].items():
        print(f"{name:<16}{row['host_us']:>10.1f}{row['host_vs_full_before']:>15.2f}x{row['step_us']:>10.1f}")


if __name__ == "__main__":
    main()
