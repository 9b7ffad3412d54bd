"""The GPU proof of issue 45: correctness, the fill, capture and the step gap, serving, in one run.

    python3 benchmarks/gpu_proof.py [--smoke] [--parts 1,2,3,4] [--budget SECONDS] [--out DIR]

The device call (the lent H200; docs/benchmarks.md, "GPU proof"), from the repository
root, ``carry: [".whl"]``, ``timeout_s`` 600::

    python3 benchmarks/gpu_proof.py --budget 540

It installs ``.whl/*.whl`` first when that folder exists (``pip install --no-index
--no-deps --upgrade --target $TMPDIR/gpu_proof_site``, then on every piece's
``PYTHONPATH`` with the working tree; the device has no registry). The wheels, for
Python 3.12 (made by ``pip download --no-deps --only-binary=:all: --python-version 3.12
...`` as /work/shared/GPU.md says, and ``python3 benchmarks/proof_wheels.py
--sglang-wheel .whl``): pydantic 2.13.4, pydantic-core 2.46.4, annotated-types 0.7.0,
typing-inspection 0.4.2, typing-extensions 4.16.0 (pydantic needs >= 4.14.1; the
image's version is not known), msgspec 0.22.0, and sglang 0.5.23 as a slim wheel of
the five files the fill needs (proof_wheels.py says why). ``.whl/`` is git-ignored,
never committed.

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
targets, rewritten every few seconds while its pieces run (``"state": "running"``), so
a device call cut short still brings back what was measured; then prints its table.
``$OUT/environment.json`` has the versions and the wheels installed, ``$OUT/pieces.log``
the tail of every piece's output. Nothing else goes to ``$OUT``: the device call brings
back at most 8 files there (the pieces' own logs and result files stay in a work
folder, ``--work``). Before any part, a preflight (proof_preflight.py, seconds) checks
that graphslot imports and builds a registry (the wheels installed) and, without
``--smoke``, that torch sees a GPU; when not, gpu_proof stops there, exit 2, saying
why. ``--smoke``: the same pieces on the CPU (tape backend, tiny shapes; CUDA-only
figures null), several pieces sharing a process; checks the script
(tests/test_gpu_proof.py). Exit 1 when a piece failed or timed out.
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
from typing import Any, Callable, Dict, List, Optional, Tuple

import proof_report
import proof_wheels

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PY = sys.executable
#: Part -> (name, most seconds, seconds kept for it while earlier parts run).
PARTS = {1: ("correctness", 300, 0), 2: ("fill", 120, 45), 3: ("capture", 180, 90), 4: ("serving", None, 60)}
TAIL = 3000  # characters of a failed piece's output kept in its part's JSON
LOG_TAIL = 20000  # characters of each output stream of a piece kept in $OUT/pieces.log
PROGRESS_S = 5.0  # seconds between rewrites of a running part's file


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


def script(name: str, work: Path, what: Optional[str], smoke: bool) -> Piece:
    """A proof_<module>.py piece (``what``: its cases), writing work/results/<piece>.json."""
    label = name if what is None else f"{name}_{what.replace(',', '_')}"
    result = work / "results" / f"{label}.json"
    argv = [PY, str(BENCH / f"proof_{name}.py"), "--result", str(result)]
    argv += ["--what", what] if what else []
    argv += ["--smoke"] if smoke else []
    return Piece(label, argv, result=result)


def cuda_test_files() -> List[str]:
    """The test files that mark CUDA tests (collecting only them saves the suite's collection)."""
    files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
             if "mark.cuda" in p.read_text()]
    return files or ["tests"]


def plan(part: int, smoke: bool, work: Path) -> List[Piece]:
    cli = [PY, "-m", "graphslot.cli", "demo", "--json"]
    if part == 1:
        pytest = [PY, "-m", "pytest", "-m", "cuda", "-x", "-rsfE", "-p", "no:cacheprovider", *cuda_test_files()]
        decode = cli + (["--backend", "cpu", "--steps", "20"] if smoke else [])
        prefill = cli + ["--workload", "prefill"] + (["--backend", "cpu", "--batches", "4"] if smoke else [])
        modes = [script("demo", work, "breakable,piecewise", smoke)] if smoke else [
            script("demo", work, mode, smoke) for mode in ("breakable", "piecewise")]
        return [Piece("pytest_cuda", pytest, kind="pytest"), Piece("demo_decode_cli", decode, kind="stdout_json"),
                Piece("demo_prefill_cli", prefill, kind="stdout_json"), *modes, script("batcher", work, None, smoke)]
    if part == 2:
        return [script("fill", work, None, smoke)]
    if part == 3:
        if smoke:
            return [script("capture", work, "full,breakable,piecewise,gap", smoke)]
        return [script("capture", work, what, smoke) for what in ("full", "gap", "breakable", "piecewise")]
    return [script("serving", work, None, smoke)]


class Runner:
    """Starts pieces with the run's environment and collects them by a deadline. Their
    logs and result files go to ``work``; ``out`` (what the device call brings back, 8
    files at most) gets the part files and ``pieces.log`` only."""

    def __init__(self, out: Path, work: Path, env: Dict[str, str]):
        self.out = out
        self.work = work
        self.env = env
        (work / "logs").mkdir(parents=True, exist_ok=True)
        (work / "results").mkdir(parents=True, exist_ok=True)

    def log(self, piece: Piece, stream: str) -> Path:
        return self.work / "logs" / f"{piece.name}.{stream}"

    def start(self, piece: Piece) -> None:
        piece.started = time.monotonic()
        print(f"gpu_proof: {piece.name}: {' '.join(piece.argv[1:])}", file=sys.stderr, flush=True)
        with open(self.log(piece, "out"), "w") as stdout, open(self.log(piece, "err"), "w") as stderr:
            piece.proc = subprocess.Popen(piece.argv, cwd=ROOT, env=self.env, stdout=stdout, stderr=stderr,
                                          start_new_session=True)

    def output(self, piece: Piece) -> Tuple[str, str]:
        return (self.log(piece, "out").read_text(errors="replace"), self.log(piece, "err").read_text(errors="replace"))

    def progress(self, piece: Piece) -> Dict[str, Any]:
        """A running piece's record: what its result file holds so far."""
        stdout = self.output(piece)[0]
        return {"command": " ".join(piece.argv[1:]), "running": True,
                "seconds": round(time.monotonic() - piece.started, 2), "result": self.collect(piece, stdout)}

    def finish(self, piece: Piece, deadline: float, waiting: Callable[[], None] = lambda: None) -> Dict[str, Any]:
        """Wait for ``piece`` until ``deadline`` (then kill it), calling ``waiting`` every
        :data:`PROGRESS_S` seconds meanwhile."""
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            try:
                rc = piece.proc.wait(timeout=max(0.0, min(PROGRESS_S, left)))
                break
            except subprocess.TimeoutExpired:
                if left <= PROGRESS_S:
                    timed_out = True
                    rc = self.kill(piece.proc)
                    break
                waiting()
        seconds = time.monotonic() - piece.started
        out, err = self.output(piece)
        record: Dict[str, Any] = {"command": " ".join(piece.argv[1:]), "rc": rc, "seconds": round(seconds, 2),
                                  "timed_out": timed_out, "result": self.collect(piece, out)}
        if rc != 0 or timed_out:
            record["tail"] = (err + out)[-TAIL:]
        piece.record = record
        with open(self.out / "pieces.log", "a") as log:
            log.write(f"==== {piece.name} (rc {rc}{', timed out' if timed_out else ''}, {seconds:.1f} s): "
                      f"{record['command']}\n---- stderr (tail)\n{err[-LOG_TAIL:]}\n---- stdout (tail)\n"
                      f"{out[-LOG_TAIL:]}\n")
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


def write_json(path: Path, data: Any) -> None:
    """``data`` to ``path`` whole or not at all (a kill mid-write leaves the last version)."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def run_part(part: int, runner: Runner, smoke: bool, deadline: float) -> Dict[str, Any]:
    """Every piece of ``part``: side by side for part 1 (correctness only, no timings),
    one after another otherwise. The part's file is rewritten as pieces finish and every
    :data:`PROGRESS_S` seconds while they run (``"state": "running"``)."""
    name = PARTS[part][0]
    start = time.monotonic()
    pieces = plan(part, smoke, runner.work)
    records: Dict[str, Any] = {}
    path = runner.out / f"part{part}_{name}.json"

    def save(state: str) -> Dict[str, Any]:
        shown = {p.name: records[p.name] if p.name in records else runner.progress(p)
                 for p in pieces if p.name in records or p.proc is not None}
        result = {"part": part, "name": name, "smoke": smoke, "state": state,
                  "budget_s": round(deadline - start, 1), "seconds": round(time.monotonic() - start, 2),
                  "pieces": shown, "summary": guarded(proof_report.summarize, part, shown)}
        write_json(path, result)
        return result

    def running() -> None:
        save("running")

    if part == 1:
        for piece in pieces:
            runner.start(piece)
        for piece in pieces:
            records[piece.name] = runner.finish(piece, deadline, running)
            running()
    else:
        for piece in pieces:
            if time.monotonic() >= deadline:
                records[piece.name] = {"skipped": "out of time (the part's deadline passed)"}
                continue
            runner.start(piece)
            records[piece.name] = runner.finish(piece, deadline, running)
            running()
    result = save("done")
    table = guarded(proof_report.table, result)
    print(table if isinstance(table, str) else f"== part {part}: {name}: no table ({table['error']}); "
          f"{path.name} holds the figures", flush=True)
    return result


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``{"error": ...}`` when it raises: a piece's figures in a shape the
    summary or the table did not expect must not end the run (the parts after it)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 -- reported in the part's file and table line
        return {"error": f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}"}


def preflight(env: Dict[str, str], wheels: Dict[str, Any], cuda: bool, timeout: float = 120) -> Dict[str, Any]:
    """proof_preflight.py with the pieces' environment: versions, and ``problems`` that
    would fail every piece (an empty list when there are none)."""
    argv = [PY, str(BENCH / "proof_preflight.py")] + (["--cuda"] if cuda else [])
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        found = json.loads(proc.stdout) if proc.returncode == 0 else {
            "problems": [f"the preflight failed (rc {proc.returncode}): {proc.stderr[-TAIL:]}"]}
    except (subprocess.TimeoutExpired, ValueError) as exc:
        found = {"problems": [f"the preflight did not answer: {type(exc).__name__}: {exc}"]}
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
    parser.add_argument("--work", default=None,
                        help="the pieces' logs and result files (default a new temporary folder)")
    parser.add_argument("--wheels", choices=("auto", "off"), default="auto",
                        help="auto: install .whl/*.whl first when the folder exists (not with --smoke)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_proof_"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pieces.log").write_text("")
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_proof_work_"))
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
    found = preflight(env, wheels, cuda=not args.smoke)
    write_json(out / "environment.json", found)
    print(proof_report.environment_line(found, out), flush=True)
    if found["problems"]:
        print("gpu_proof: cannot run here, no part started (environment.json has the versions):\n  "
              + "\n  ".join(found["problems"]), flush=True)
        return 2
    runner = Runner(out, work, env)
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
