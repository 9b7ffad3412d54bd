"""Spawn N ranks in a ``torch.distributed`` process group, with a hard timeout.

:func:`launch` runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes
joined in one process group (gloo over localhost on a free port, or NCCL with one GPU a
rank) and returns their results in rank order. A rank that raises fails the launch with
its traceback at once (the others, likely waiting for it in a collective, are killed);
ranks still running at the deadline (a hang in a collective) are killed and the launch
fails naming them -- it never waits longer than ``timeout``.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import tempfile
import time
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable, List, Sequence

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised, or did not finish in time; ``summary`` is one line, ``str`` adds the
    failing rank's traceback."""

    def __init__(self, summary: str, traceback_text: str = ""):
        super().__init__(f"{summary}\n{traceback_text}" if traceback_text else summary)
        self.summary = summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               timeout: float, args: Sequence[Any], out_dir: str) -> None:
    out = Path(out_dir) / f"rank{rank}"
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        out.with_suffix(".pkl").write_bytes(pickle.dumps(result))
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise SystemExit(1)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           backend: str = "gloo") -> List[Any]:
    """``fn(rank, world_size, *args)`` on every rank (``fn`` importable by module path);
    the results, rank by rank. Raises :class:`RankFailure` on an error or at the deadline."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="graphslot-dp-") as out_dir:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, rank, world_size, port, backend, timeout, args, out_dir))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        running = list(procs)
        # Until all are done, one fails (the others may wait for it in a collective), or time is up.
        while running and time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs):
            connection.wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in running if p.is_alive()]
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {rank: (Path(out_dir) / f"rank{rank}.err") for rank in range(world_size)}
        for rank, path in errors.items():
            if path.exists():
                text = path.read_text()
                last = [line for line in text.splitlines() if line.strip()][-1]
                raise RankFailure(f"DP rank {rank} of {world_size} failed: {last}", text)
        if hung:
            raise RankFailure(f"DP rank(s) {', '.join(map(str, hung))} of {world_size} still running after "
                              f"{timeout:.0f} s (a hang in a collective?); killed")
        failed = [rank for rank, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RankFailure(f"DP rank(s) {', '.join(map(str, failed))} exited with "
                              f"{', '.join(str(procs[r].exitcode) for r in failed)}")
        return [pickle.loads((Path(out_dir) / f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
