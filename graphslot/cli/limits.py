"""The most each count a ``graphslot`` command takes may be.

Every count a user types is checked against its limit before anything is built or run,
and one over it is a usage error naming the flag (exit 2): ``demo --max-bs 1000000``
once zero-filled a 32 GiB KV pool and captured graphs at 766 sizes until the kernel
killed it, ``bench --repeats 100000000`` was still timing after 90 s. At the limits a
run stays within about a GiB of memory on the CPU tape (the decode demo at
``--max-bs 256``: 0.8 GB; a step kept for the report: about 6 KiB) and ``bench`` within
a few minutes. A limit that holds whatever else is typed is the flag's argparse
``type`` (:meth:`Limit.argument`); one that depends on another flag (``--workload``, a
product of two counts) is checked after parsing (:meth:`Limit.check`).
tests/test_cli.py checks that every integer flag of every command has one. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from ..planning.histogram import MAX_BATCH_SIZE
from ..planning.planner import MAX_GRAPHS
from .common import positive_int

#: The prefill demo's request slots, and how many requests it keeps cached between
#: batches: a batch takes at most the rest.
PREFILL_REQUEST_SLOTS = 64
PREFILL_CACHED = 16


@dataclass(frozen=True)
class Limit:
    most: int
    why: str

    def message(self, value: int, where: str = "", got: Optional[str] = None) -> str:
        return f"{got or value} is over the limit of {self.most}{where} ({self.why})"

    def check(self, parser: argparse.ArgumentParser, flag: str, value: Optional[int], where: str = "",
              got: Optional[str] = None) -> None:
        """A usage error naming ``flag`` when ``value`` is over the limit (``got``: how
        the error shows the value, when it is not the flag's own)."""
        if value is not None and value > self.most:
            parser.error(f"argument {flag}: {self.message(value, where, got)}")

    def argument(self) -> Callable[[str], int]:
        """An argparse ``type``: a positive integer up to the limit (argparse names the
        flag in the usage error). The function carries the limit as ``.limit``."""

        def count(text: str) -> int:
            value = positive_int(text)
            if value > self.most:
                raise argparse.ArgumentTypeError(self.message(value))
            return value

        count.limit = self  # type: ignore[attr-defined]
        return count


MAX_BS = Limit(256, "graphs are captured at sizes up to it, and their memory grows with it")
PREFILL_MAX_BS = Limit(PREFILL_REQUEST_SLOTS - PREFILL_CACHED,
                       f"a batch and the {PREFILL_CACHED} requests the demo keeps cached share its "
                       f"{PREFILL_REQUEST_SLOTS} request slots")
MAX_STEPS = Limit(100_000, "the demo keeps every step's batch for its report")
MAX_BATCHES = Limit(100_000, "the demo keeps every batch for its report")
MAX_DP = Limit(8, "each rank is a process with a model and graphs of its own")
#: ``--dp`` times ``--steps``: every rank sends the logits of every step back.
MAX_RANK_STEPS = Limit(20_000, "every rank's logits of every step are kept to check")

#: ``graphslot verify --samples``.
MAX_SAMPLES = Limit(256, "each raw size is replayed once per poisoned slot and pattern")

#: ``graphslot bench``: a call of every runner at every size takes about 0.5 ms on a laptop CPU.
MAX_ITERS = Limit(100_000, "every runner makes this many calls per sample at every size")
MAX_REPEATS = Limit(100, "every runner is sampled this many times at every size")
#: ``--iters`` times ``--repeats`` (the defaults: 14,000, about 7 s).
MAX_CALLS = Limit(200_000, "a call of every runner at every size takes about 0.5 ms on a laptop CPU: about 2 "
                           "minutes at the limit")

#: ``graphslot show`` and ``graphslot plan-sizes``: capacities.
MAX_CAPACITY = Limit(MAX_BATCH_SIZE, "no engine captures graphs this large; a histogram holds sizes up to it")
MAX_PLAN_GRAPHS = Limit(MAX_GRAPHS, "the plan is exact dynamic programming over graphs and sizes")
