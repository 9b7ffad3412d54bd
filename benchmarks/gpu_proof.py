"""The GPU proof of issue 45: correctness, the fill, capture and the step gap, serving, in one run.

    python3 benchmarks/gpu_proof.py [--smoke] [--parts 1,2,3,4] [--budget SECONDS] [--out DIR]

The device call (the lent H200; docs/benchmarks.md, "GPU proof"), from the repository
root, ``carry: [".whl"]``, ``timeout_s`` 600::

    python3 benchmarks/gpu_proof.py --budget 540

It installs ``.whl/*.whl`` first when that folder exists (``pip install --no-index
--no-deps --target $TMPDIR/gpu_proof_site``, then on every piece's ``PYTHONPATH`` with
the working tree; the device has no registry). The wheels, for Python 3.12 (made by
``pip download --no-deps --only-binary=:all: --python-version 3.12 ...`` as
/work/shared/GPU.md says, and ``python3 benchmarks/proof_wheels.py --sglang-wheel
.whl``): pydantic 2.13.4, pydantic-core 2.46.4, annotated-types 0.7.0,
typing-inspection 0.4.2, msgspec 0.22.0, and sglang 0.5.23 as a slim wheel of the five
files the fill needs (proof_wheels.py says why). ``.whl/`` is git-ignored, never committed.

Parts, in this order, each a set of pieces run as subprocesses with a deadline (a piece
that hangs or kills its CUDA context is killed or dies alone; its return code and the
tail of its output are recorded and the next part runs):

1. correctness (at most 300 s; its pieces run side by side): ``pytest -m cuda -x`` on the
   test files that mark CUDA tests (skips listed with their reasons: two-GPU tests say
   so); ``graphslot demo`` (decode, capture "full") and ``graphslot demo --workload
   prefill`` (breakable and piecewise) as commands, and the decode demo under
   "breakable" and "piecewise" (proof_demo.py); the transformers batcher at a 1B shape
   against ``generate``, before and after ``torch.compile(mode="reduce-overhead")`` in
   the same process (proof_batcher.py);
2. the fill (at most 120 s): proof_fill.py, the drop-in against sglang's registry with the
   fast path off and on, on sglang's ``ForwardBatch``;
3. capture and the step gap (at most 180 s): proof_capture.py, 35 decode sizes at the 1B
   shape per capture mode (one process each), and the step gap at bs 1, 32, 256;
4. serving (what is left of ``--budget``): proof_serving.py.

Each part writes ``$OUT/part<N>_<name>.json`` (``OUT`` from the environment, else
``--out``, else a new temporary folder) with every piece's figures and a summary of
targets, and prints its table; ``$OUT/environment.json`` has the versions and the wheels
installed, ``$OUT/logs/`` every piece's output. ``--smoke``: the same pieces on the CPU
(tape backend, tiny shapes; CUDA-only figures null), several pieces sharing a process;
checks the script (tests/test_gpu_proof.py). Exit 1 when a piece failed or timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import proof_report
import proof_wheels

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PY = sys.executable
#: Part -> (name, most seconds, seconds kept for it while earlier parts run).
PARTS = {1: ("correctness", 300, 0), 2: ("fill", 120, 45), 3: ("capture", 180, 90), 4: ("serving", None, 60)}
TAIL = 3000  # characters of a failed piece's output kept in its part's JSON


@dataclass
class Piece:
    name: str
    argv: List[str]
    #: How its figures come back: "result" (it writes --result), "stdout_json", "pytest".
    kind: str = "result"
    result: Optional[Path] = None
    proc: Any = None
    started: float = 0.0
    record: Dict[str, Any] = field(default_factory=dict)


def script(name: str, out: Path, what: Optional[str], smoke: bool) -> Piece:
    """A proof_<module>.py piece (``what``: its cases), writing out/results/<piece>.json."""
    label = name if what is None else f"{name}_{what.replace(',', '_')}"
    result = out / "results" / f"{label}.json"
    argv = [PY, str(BENCH / f"proof_{name}.py"), "--result", str(result)]
    argv += ["--what", what] if what else []
    argv += ["--smoke"] if smoke else []
    return Piece(label, argv, result=result)


def cuda_test_files() -> List[str]:
    """The test files that mark CUDA tests (collecting only them saves the suite's collection)."""
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
             if "mark.cuda" in p.read_text()]
    return files or ["tests"]


def plan(part: int, smoke: bool, out: Path) -> List[Piece]:
    cli = [PY, "-m", "graphslot.cli", "demo", "--json"]
    if part == 1:
        pytest = [PY, "-m", "pytest", "-m", "cuda", "-x", "-rsfE", "-p", "no:cacheprovider", *cuda_test_files()]
        decode = cli + (["--backend", "cpu", "--steps", "20"] if smoke else [])
        prefill = cli + ["--workload", "prefill"] + (["--backend", "cpu", "--batches", "4"] if smoke else [])
        modes = [script("demo", out, "breakable,piecewise", smoke)] if smoke else [
            script("demo", out, mode, smoke) for mode in ("breakable", "piecewise")]
        return [Piece("pytest_cuda", pytest, kind="pytest"), Piece("demo_decode_cli", decode, kind="stdout_json"),
                Piece("demo_prefill_cli", prefill, kind="stdout_json"), *modes, script("batcher", out, None, smoke)]
    if part == 2:
        return [script("fill", out, None, smoke)]
    if part == 3:
        if smoke:
            return [script("capture", out, "full,breakable,piecewise,gap", smoke)]
        return [script("capture", out, what, smoke) for what in ("full", "gap", "breakable", "piecewise")]
    return [script("serving", out, None, smoke)]


class Runner:
    """Starts pieces with the run's environment and collects them by a deadline."""

    def __init__(self, out: Path, env: Dict[str, str]):
        self.out = out
        self.env = env
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "results").mkdir(parents=True, exist_ok=True)

    def start(self, piece: Piece) -> None:
        log = self.out / "logs" / piece.name
        piece.started = time.monotonic()
        print(f"gpu_proof: {piece.name}: {' '.join(piece.argv[1:])}", file=sys.stderr, flush=True)
        with open(f"{log}.out", "w") as stdout, open(f"{log}.err", "w") as stderr:
            piece.proc = subprocess.Popen(piece.argv, cwd=ROOT, env=self.env, stdout=stdout, stderr=stderr,
                                          start_new_session=True)

    def finish(self, piece: Piece, deadline: float) -> Dict[str, Any]:
        timed_out = False
        try:
            rc = piece.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = self.kill(piece.proc)
        seconds = time.monotonic() - piece.started
        log = self.out / "logs" / piece.name
        out = Path(f"{log}.out").read_text(errors="replace")
        err = Path(f"{log}.err").read_text(errors="replace")
        record: Dict[str, Any] = {"command": " ".join(piece.argv[1:]), "rc": rc, "seconds": round(seconds, 2),
                                  "timed_out": timed_out, "result": self.collect(piece, out)}
        if rc != 0 or timed_out:
            record["tail"] = (err + out)[-TAIL:]
        piece.record = record
        state = "timed out" if timed_out else f"rc {rc}"
        print(f"gpu_proof: {piece.name}: {state} after {seconds:.1f} s", file=sys.stderr, flush=True)
        return record

    @staticmethod
    def kill(proc: subprocess.Popen) -> int:
        """SIGTERM to the piece's process group, SIGKILL 5 s later (a CUDA hang ignores the first)."""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return proc.wait()

    @staticmethod
    def collect(piece: Piece, stdout: str) -> Any:
        if piece.kind == "pytest":
            return proof_report.parse_pytest(stdout)
        if piece.kind == "stdout_json":
            try:
                return json.loads(stdout)
            except ValueError:
                return None
        try:
            return json.loads(piece.result.read_text())
        except (OSError, ValueError):  # never written, or cut mid-write
            return None


def run_part(part: int, runner: Runner, smoke: bool, deadline: float) -> Dict[str, Any]:
    """Every piece of ``part``: side by side for part 1 (correctness only, no timings),
    one after another otherwise."""
    name = PARTS[part][0]
    start = time.monotonic()
    pieces = plan(part, smoke, runner.out)
    records: Dict[str, Any] = {}
    if part == 1:
        for piece in pieces:
            runner.start(piece)
        for piece in pieces:
            records[piece.name] = runner.finish(piece, deadline)
    else:
        for piece in pieces:
            if time.monotonic() >= deadline:
                records[piece.name] = {"skipped": "out of time (the part's deadline passed)"}
                continue
            runner.start(piece)
            records[piece.name] = runner.finish(piece, deadline)
    result = {"part": part, "name": name, "smoke": smoke, "budget_s": round(deadline - start, 1),
              "seconds": round(time.monotonic() - start, 2), "pieces": records}
    result["summary"] = proof_report.summarize(part, records)
    path = runner.out / f"part{part}_{name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(proof_report.table(result), flush=True)
    return result


def environment(env: Dict[str, str], wheels: Dict[str, Any], timeout: float = 120) -> Dict[str, Any]:
    """Versions as the pieces see them (a subprocess with their PYTHONPATH)."""
    probe = ("import json, platform, importlib.metadata as md, torch\n"
             "def v(n):\n    try:\n        return md.version(n)\n    except Exception:\n        return None\n"
             "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__,"
             " 'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None,"
             " **{n: v(n) for n in ('transformers', 'triton', 'pydantic', 'sglang', 'msgspec', 'hypothesis')}}))")
    try:
        proc = subprocess.run([PY, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        found = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-TAIL:]}
    except (subprocess.TimeoutExpired, ValueError) as exc:
        found = {"error": f"{type(exc).__name__}: {exc}"}
    return {**found, "wheels": wheels, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def parse_parts(text: str) -> List[int]:
    try:
        parts = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        parts = []
    if not parts or any(p not in PARTS for p in parts):
        raise argparse.ArgumentTypeError(f"--parts takes part numbers among {sorted(PARTS)}, e.g. 1,3; got {text!r}")
    return parts


def budgets(parts: List[int], total: float, start: float):
    """Each part's deadline: its own most seconds, and room kept for the parts after it."""
    end = start + total
    for i, part in enumerate(parts):
        now = time.monotonic()
        reserve = sum(PARTS[p][2] for p in parts[i + 1:])
        cap = PARTS[part][1]
        deadline = end - reserve if cap is None else min(now + cap, end - reserve)
        yield part, max(deadline, now + 10)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU (tape backend), tiny shapes: checks the script")
    parser.add_argument("--parts", type=parse_parts, default=sorted(PARTS), help="parts to run, e.g. 1,3 (default all)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default 540: one 600 s device call; smoke 900)")
    parser.add_argument("--out", default=None, help="results folder (default $OUT, else a new temporary folder)")
    parser.add_argument("--wheels", choices=("auto", "off"), default="auto",
                        help="auto: install .whl/*.whl first when the folder exists (not with --smoke)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_proof_"))
    out.mkdir(parents=True, exist_ok=True)
    paths = [str(ROOT)]
    wheels: Dict[str, Any] = {"installed": [], "reason": "--wheels off" if args.wheels == "off" else "no .whl/ folder"}
    if args.wheels == "auto" and (ROOT / ".whl").is_dir():
        if args.smoke:
            wheels["reason"] = "--smoke uses this machine's packages"
        else:
            site = Path(tempfile.gettempdir()) / "gpu_proof_site"
            wheels = proof_wheels.install(ROOT / ".whl", site)
            paths.append(str(site))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "HYPOTHESIS_PROFILE": "ci", "PYTHONUNBUFFERED": "1"}
    found = environment(env, wheels)
    (out / "environment.json").write_text(json.dumps(found, indent=1))
    print(proof_report.environment_line(found, out), flush=True)
    runner = Runner(out, env)
    total = args.budget or (900.0 if args.smoke else 540.0)
    results = [run_part(part, runner, args.smoke, deadline) for part, deadline in budgets(args.parts, total, start)]
    failed = [f"part {r['part']} {name}" for r in results for name, p in r["pieces"].items()
              if p.get("rc", 0) != 0 or p.get("timed_out") or "skipped" in p]
    took = time.monotonic() - start
    print(f"gpu_proof: {len(results)} part(s) in {took:.0f} s; results in {out}"
          + (f"; failed or cut: {', '.join(failed)}" if failed else "; every piece ran to its end"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
