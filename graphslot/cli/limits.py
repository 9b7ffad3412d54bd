"""The most each count of ``graphslot demo`` and ``graphslot verify`` may be.

Every count a user types is checked against its limit before anything is built, and one
over it is a usage error naming the flag (exit 2): ``--max-bs 1000000`` once zero-filled
a 32 GiB KV pool and captured graphs at 766 sizes until the kernel killed it. At the
limits a run stays within about a GiB of memory on the CPU tape (the decode demo at
``--max-bs 256``: 0.8 GB; a step kept for the report: about 6 KiB). Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

#: The prefill demo's request slots, and how many requests it keeps cached between
#: batches: a batch takes at most the rest.
PREFILL_REQUEST_SLOTS, PREFILL_CACHED = 64, 16


@dataclass(frozen=True)
class Limit:
    most: int
    why: str

    def check(self, parser: argparse.ArgumentParser, flag: str, value: Optional[int], where: str = "",
              got: Optional[str] = None) -> None:
        """A usage error naming ``flag`` when ``value`` is over the limit (``got``: how
        the error shows the value, when it is not the flag's own)."""
        if value is not None and value > self.most:
            parser.error(f"argument {flag}: {got or value} is over the limit of {self.most}{where} ({self.why})")


MAX_BS = Limit(256, "graphs are captured at sizes up to it, and their memory grows with it")
PREFILL_MAX_BS = Limit(PREFILL_REQUEST_SLOTS - PREFILL_CACHED,
                       f"a batch and the {PREFILL_CACHED} requests the demo keeps cached share its "
                       f"{PREFILL_REQUEST_SLOTS} request slots")
MAX_STEPS = Limit(100_000, "the demo keeps every step's batch for its report")
MAX_BATCHES = Limit(100_000, "the demo keeps every batch for its report")
MAX_DP = Limit(8, "each rank is a process with a model and graphs of its own")
#: ``--dp`` times ``--steps``: every rank sends the logits of every step back.
MAX_RANK_STEPS = Limit(20_000, "every rank's logits of every step are kept to check")
