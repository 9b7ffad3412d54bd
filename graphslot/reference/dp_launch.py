"""Spawn N ranks in a ``torch.distributed`` process group, with a hard timeout.

:func:`launch` runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes
joined in one process group (gloo over localhost on a free port, or NCCL with one GPU a
rank) and returns their results in rank order. It never waits longer than ``timeout``.

A rank that raises reports it at once over its own pipe (the error's type, message,
traceback and a timestamp); the launcher then gives the others a moment to report too
and kills those still running. It blames the rank whose own error came first, never a
survivor: a rank that only stopped because of a peer -- a
:class:`~graphslot.runners.dp_exchange.DPStepError` naming another rank, a collective that lost
its peer (connection closed, timed out), the launcher's kill -- is listed as a
consequence ("DP rank 1 of 2 failed: SlotError: ...; rank 0 stopped because rank 1
failed"). A rank that dies without a report (a signal, an abort) is the culprit when no
rank reported an error of its own; so is a rank whose function returned while the
others still waited for it in a collective, when they only lost their peer ("DP rank 1
of 2 returned while rank 0 still waited for it in a collective; rank 0 stopped because
rank 1 returned early").

A rank still running when the watch ends (the deadline, or the grace after a peer's
error) is asked for its Python stack first (``faulthandler`` on ``SIGUSR1``, which
answers even inside a blocking C call): a rank waiting in a collective (a frame in
``torch.distributed``, the tape's collective replay, or a line that calls a collective
op) waited for the others; one running elsewhere did not finish and is named, with its
stack ("DP rank 1 of 2 did not finish: still running after 30 s outside any collective;
killed; rank 0 stopped waiting for rank 1").
"""

from __future__ import annotations

import datetime
import faulthandler
import linecache
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds the launcher waits, after a rank's own error, for the others' reports.
GRACE_AFTER_ERROR = 1.0
#: Seconds it waits, after only consequences or deaths, for the culprit's report.
GRACE_AFTER_CONSEQUENCE = 5.0
MAX_TRACEBACK_CHARS = 20_000
#: What gloo or NCCL says when a collective's peer is gone: a consequence, not a cause.
PEER_LOST = ("connection closed by peer", "connection reset by peer", "timed out waiting",
             "watchdog caught collective operation timeout", "nccl communicator was aborted")
#: The signal a rank dumps its Python stack on, and how long the launcher waits for the dump.
STACK_SIGNAL = signal.SIGUSR1
STACK_WAIT = 2.0
#: A source line that calls a collective (a frame of a rank waiting in one).
COLLECTIVE_CALL = re.compile(r"\b(all_gather|all_reduce|reduce_scatter|all_to_all|broadcast|barrier|wait_tensor|"
                             r"send|recv)\w*\(")
FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)')


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time. ``summary`` is one line naming
    the failing rank and its own error; ``details`` (also in ``str``) adds the
    failing rank's traceback; ``culprits`` the ranks blamed."""

    def __init__(self, summary: str, details: str = "", culprits: Sequence[int] = ()):
        super().__init__(f"{summary}\n{details}" if details else summary)
        self.summary = summary
        self.details = details
        self.culprits = list(culprits)


@dataclass
class RankReport:
    """What a failing rank tells the launcher (picklable, plain data)."""

    rank: int
    time: float
    #: (type name, message) of the rank's own error, or of the error it stopped on.
    error: Tuple[str, str]
    traceback: str
    #: True: the rank stopped because of a peer (``blamed`` says which, when it knows).
    consequence: bool = False
    blamed: Dict[int, Tuple[str, str]] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_lost(exc: BaseException) -> bool:
    """Whether a collective raised because a peer is gone (closed, reset, timed out)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(sign in text for sign in PEER_LOST)


def rank_report(rank: int, exc: BaseException) -> RankReport:
    """The report of ``rank``, which raised ``exc``."""
    from ..runners.dp_exchange import DPStepError, describe_error

    text = traceback.format_exc()[-MAX_TRACEBACK_CHARS:]
    error = describe_error(exc)
    if isinstance(exc, DPStepError):
        own = exc.failures.get(rank)
        return RankReport(rank, time.time(), own or error, text, consequence=own is None, blamed=exc.failures)
    return RankReport(rank, time.time(), error, text, consequence=peer_lost(exc))


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               timeout: float, args: Sequence[Any], out_dir: str, report: Any) -> None:
    stacks = open(stack_path(out_dir, rank), "w")  # open until the rank ends (os._exit)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 -- reported, then the rank exits
        report.send(rank_report(rank, exc))  # first: the launcher may kill this process any moment now
        _leave(1)  # no group teardown: its peers may be gone (the launcher kills a hang)
    dist.destroy_process_group()
    _leave(0)


def _leave(code: int) -> None:
    """End the rank now, without the interpreter's teardown: its result is written and
    its group destroyed (or its error reported), so nothing is left to do there, and a
    crash there would fail a rank whose work is done. Such crashes happened: a process
    group an uncollected cycle still holds (a runner's exchange, say) outlives
    ``destroy_process_group``; when a peer closed its connections during this rank's
    teardown, gloo aborted it ("terminate called without an active exception", SIGABRT;
    4 of 56 launches of one test's ranks on a 2-core machine). ``atexit`` handlers do
    not run in a rank."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def stack_path(out_dir: str, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.stack"


def main_stack(dump: str) -> str:
    """The rank's main thread in a ``faulthandler`` dump (the one running ``_rank_main``); "" if none."""
    return next((block for block in dump.split("\n\n") if " in _rank_main" in block), "")


def in_collective(stack: str) -> Optional[bool]:
    """Whether a rank's main-thread stack waits in a collective: its innermost frame
    outside torch's own dispatch is in ``torch.distributed``, is the tape's collective
    replay, or calls a collective; None for no stack."""
    frames = [m.groups() for m in map(FRAME.match, stack.splitlines()) if m]
    for path, line, function in frames:  # most recent call first
        if "/torch/distributed/" in path or function == "_run_collective":
            return True
        if "/torch/" not in path:
            return bool(COLLECTIVE_CALL.search(linecache.getline(path, int(line))))
    return None if not frames else False


@dataclass
class Watched:
    """How the ranks ended: their reports, the ranks that exited (when, with what
    code, by the monotonic clock), those still running when the watch ended (then
    killed), how long it ran, and the main-thread stacks of those still running."""

    reports: Dict[int, RankReport]
    exits: Dict[int, Tuple[float, int]]
    running: List[int]
    seconds: float
    stacks: Dict[int, str] = field(default_factory=dict)


def verdict(w: Watched, world_size: int) -> Optional[RankFailure]:
    """None when every rank finished; else the failure to raise, blaming in this order
    the rank whose own error came first, the rank(s) a peer's DPStepError names, the
    first rank that died without a report, the ranks that returned while the others
    lost them in a collective (its function returned early), the ranks still running
    (a hang)."""
    own = sorted((r for r in w.reports.values() if not r.consequence), key=lambda r: r.time)
    blamed: Dict[int, Tuple[str, str]] = {}
    for report in w.reports.values():
        blamed.update(report.blamed)
    silent = sorted((t, rank) for rank, (t, code) in w.exits.items() if code != 0 and rank not in w.reports)
    done = sorted(rank for rank, (_, code) in w.exits.items() if code == 0)
    details = ""
    waiting = False
    ended = "failed"
    if own:
        culprits = sorted(r.rank for r in own if r.error == own[0].error)
        what = "failed: {}: {}".format(*own[0].error)
        details = own[0].traceback
    elif blamed:
        culprits = sorted(blamed)
        errors = [f"{t}: {m}" for t, m in blamed.values()]
        what = "failed: " + (errors[0] if len(set(errors)) == 1 else " / ".join(errors))
        details = next(r.traceback for r in w.reports.values() if r.blamed)
    elif silent:
        culprits = [silent[0][1]]
        code = w.exits[culprits[0]][1]
        how = f"killed by {_signal_name(code)}" if code < 0 else f"exit code {code}"
        what = f"died without reporting an error ({how})"
    elif done and w.reports:  # only peers lost: the ranks that returned left them in a collective
        culprits = done
        ended = "returned early"
        lost = sorted(w.reports)
        what = f"returned while {_ranks(lost)} still waited for {'it' if len(done) == 1 else 'them'} in a collective"
        details = w.reports[lost[0]].traceback
    elif w.running:
        waiting = True
        stuck = [r for r in w.running if in_collective(w.stacks.get(r, "")) is False]
        if stuck:  # they did not finish; the others waited for them in a collective, or stopped waiting
            culprits = stuck
            what = f"did not finish: still running after {w.seconds:.0f} s outside any collective; killed"
            details = "\n\n".join(f"rank {r}'s stack:\n{w.stacks[r]}" for r in stuck)
        else:
            culprits = list(w.running)
            what = f"still running after {w.seconds:.0f} s (a hang in a collective?); killed"
    elif w.reports:
        first = min(w.reports.values(), key=lambda r: r.time)
        culprits = [first.rank]
        details = first.traceback
        what = "failed: {}: {}".format(*first.error)
    else:
        return None
    parts = [f"DP {_ranks(culprits)} of {world_size} {what}"]
    parts += ["rank {} failed too: {}: {}".format(r.rank, *r.error) for r in own if r.rank not in culprits]
    stopped = [r for r in range(world_size) if r not in culprits and r not in done
               and not (r in w.reports and not w.reports[r].consequence)]
    if stopped:
        why = "waiting for" if waiting else "because"
        parts.append(f"{_ranks(stopped)} stopped {why} {_ranks(culprits)}{'' if waiting else ' ' + ended}")
    return RankFailure("; ".join(parts), details, culprits)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           backend: str = "gloo") -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` importable by module path);
    the results, rank by rank. Raises :class:`RankFailure` on an error or at the deadline."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="graphslot-dp-") as out_dir:
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, rank, world_size, port, backend, timeout, args, out_dir, pipes[rank][1]))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        for _, sender in pipes:
            sender.close()  # the ranks hold theirs: a reader sees EOF once its rank is gone
        failure = verdict(watch(procs, [reader for reader, _ in pipes], timeout, out_dir), world_size)
        if failure is not None:
            raise failure
        return [pickle.loads((Path(out_dir) / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]


def watch(procs: List[Any], readers: List[Any], timeout: float, out_dir: Optional[str] = None) -> Watched:
    """Wait until every rank has ended, or for a moment after the first failure (so the
    others can report theirs), or until ``timeout``; then kill what still runs, after
    reading its stack (``out_dir``: where the ranks dump them)."""
    started = time.monotonic()
    end = started + timeout
    reports: Dict[int, RankReport] = {}
    exits: Dict[int, Tuple[float, int]] = {}
    unread = dict(enumerate(readers))
    while len(exits) < len(procs) and time.monotonic() < end:
        running = [p.sentinel for rank, p in enumerate(procs) if rank not in exits]
        for ready in connection.wait(running + list(unread.values()), timeout=max(0.0, end - time.monotonic())):
            rank = next((r for r, reader in unread.items() if reader is ready), None)
            if rank is not None:
                _read(unread.pop(rank), rank, reports)
        for rank, p in enumerate(procs):
            if rank not in exits and p.exitcode is not None:
                exits[rank] = (time.monotonic(), p.exitcode)
        if reports or any(code != 0 for _, code in exits.values()):
            own = any(not r.consequence for r in reports.values())
            end = min(end, time.monotonic() + (GRACE_AFTER_ERROR if own else GRACE_AFTER_CONSEQUENCE))
    running = [rank for rank in range(len(procs)) if rank not in exits]
    stacks = {} if out_dir is None else dump_stacks(procs, running, out_dir)
    for rank in running:
        procs[rank].kill()
    for p in procs:
        p.join()
    for rank, reader in unread.items():  # sent just before the end; a killed writer's reader ends in EOF
        if reader.poll(0):
            _read(reader, rank, reports)
    return Watched(reports, exits, running, time.monotonic() - started, stacks)


def dump_stacks(procs: List[Any], ranks: List[int], out_dir: str) -> Dict[int, str]:
    """The main-thread stacks of ``ranks`` (still running), each dumped on STACK_SIGNAL;
    a rank that does not answer within STACK_WAIT seconds is left out."""
    for rank in ranks:
        try:
            os.kill(procs[rank].pid, STACK_SIGNAL)
        except ProcessLookupError:  # ended just now
            pass
    stacks: Dict[int, str] = {}
    end = time.monotonic() + STACK_WAIT
    while len(stacks) < len(ranks) and time.monotonic() < end:
        time.sleep(0.05)
        for rank in ranks:
            path = stack_path(out_dir, rank)
            stack = main_stack(path.read_text(errors="replace")) if path.exists() else ""
            if stack:
                stacks[rank] = stack
    return stacks


def _read(reader: Any, rank: int, reports: Dict[int, RankReport]) -> None:
    try:
        reports[rank] = reader.recv()
    except (EOFError, OSError, pickle.UnpicklingError):  # a rank that ended without a report
        pass
    reader.close()
