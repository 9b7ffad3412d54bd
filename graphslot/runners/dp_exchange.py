"""The collectives of data-parallel decode, apart from the runner that steps them
(:mod:`graphslot.runners.dp`, whose module doc has the protocol): :class:`DPExchange`,
the per-step all-gather of each rank's counts and flags and the settling of failures,
and :class:`DPStepError`, raised on every rank alike when any rank failed.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..spec.errors import SlotError, shorten

#: Characters of one rank's error message sent to its peers.
MAX_ERROR_CHARS = 2000
#: What a rank calls at an exchange, by the code it sends first.
CALLS = ("a step", "release()", "recapture()")
#: The end of the DPStepError of ranks that differ in their call or their graphs' lifecycle.
AFTER_A_LIFECYCLE_ERROR = (", and no rank ran its call: release() and recapture() on a DP runner are collective, "
                           "every rank calls them between the same two steps; all may go on, or all stop")


def _all_gather_into(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, else the old
    gather(out, mine, group=group)


def describe_error(exc: BaseException) -> Tuple[str, str]:
    """``(type name, message)`` of an error, the message bounded: what a rank tells its peers."""
    return type(exc).__name__, shorten(str(exc), MAX_ERROR_CHARS, quote=False)


class DPStepError(SlotError):
    """Raised on every DP rank, with the same message, when any rank failed where the
    others cannot go on without it. ``failures``: each failing rank's (error type,
    message); ``rank``: the rank that raised this one."""

    def __init__(self, failures: Mapping[int, Tuple[str, str]], rank: int, where: str, after: str = ""):
        self.failures = dict(sorted(failures.items()))
        self.rank = rank
        self._args = (where, after)
        if len(self.failures) == 1:
            (culprit, (kind, message)), = self.failures.items()
            what = f"DP rank {culprit} failed {where}: {kind}: {message}"
        else:
            what = (f"DP ranks {', '.join(map(str, self.failures))} failed {where} ("
                    + "; ".join(f"rank {r}: {kind}: {message}" for r, (kind, message) in self.failures.items()) + ")")
        super().__init__(f"{what}; every rank raised this error{after}")

    def __reduce__(self) -> Any:
        return type(self), (self.failures, self.rank, *self._args)

    @property
    def failed_ranks(self) -> List[int]:
        return list(self.failures)


class DPExchange:
    """The collectives of a DP step over a process group: the per-step exchange of token
    counts and flags, and the settling of failures."""

    def __init__(self, group: Optional[Any] = None, device: torch.device | str = "cpu"):
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = torch.device(device)

    def __call__(self, num_tokens: int, can_run: bool, failed: bool = False, longest: int = 0, *, call: int = 0,
                 generation: int = 0) -> Tuple[List[int], List[bool], List[bool], List[int]]:
        """Every rank's token count, can-run flag, failed flag and longest context; first
        :func:`check_calls` on what each calls (``call``, in :data:`CALLS`) and its ``generation``."""
        rows = self._gather_ints([call, generation, num_tokens, int(can_run), int(failed), longest])
        check_calls([row[0] for row in rows], [row[1] for row in rows], self.rank)
        return ([row[2] for row in rows], [bool(row[3]) for row in rows], [bool(row[4]) for row in rows],
                [row[5] for row in rows])

    def failed(self, mine: bool) -> List[bool]:
        """Every rank's failed flag: one int a rank."""
        return [bool(row[0]) for row in self._gather_ints([int(mine)])]

    def _gather_ints(self, mine: List[int]) -> List[List[int]]:
        everyone = torch.empty(len(mine) * self.size, dtype=torch.int64, device=self.device)
        _all_gather_into(everyone, torch.tensor(mine, dtype=torch.int64, device=self.device), self.group)
        return everyone.view(self.size, len(mine)).tolist()

    def gather_objects(self, mine: Any) -> List[Any]:
        """Every rank's picklable object (``all_gather_object``: for rare or one-off use)."""
        values: List[Any] = [None] * self.size
        dist.all_gather_object(values, mine, group=self.group)
        return values

    def settle(self, error: Optional[BaseException], failed: List[bool], where: str, after: str = "") -> None:
        """When any rank failed, raise :class:`DPStepError` on every rank (this rank's
        ``error`` chained), after gathering the failing ranks' messages."""
        if not any(failed):
            return
        told = self.gather_objects(None if error is None else describe_error(error))
        failures = {r: told[r] or ("Error", "(no message)") for r, bad in enumerate(failed) if bad}
        raise DPStepError(failures, self.rank, where, after) from error


def check_calls(calls: List[int], generations: List[int], rank: int) -> None:
    """Raise :class:`DPStepError`, the same on every rank (all hold these lists), naming
    the ranks whose call (:data:`CALLS`), else whose lifecycle generation, is not most ranks'."""
    for values, say in ((calls, lambda v: f"called {CALLS[v]}"),
                        (generations, lambda v: f"had its graphs released or recaptured {v} time(s)")):
        if len(set(values)) > 1:
            usual = min(set(values), key=lambda v: (-values.count(v), v))  # on a tie: a step, or the fewest
            others = ", ".join(str(r) for r, v in enumerate(values) if v == usual)
            failures = {r: ("RuntimeError", f"it {say(v)} while rank(s) {others} {say(usual)}")
                        for r, v in enumerate(values) if v != usual}
            raise DPStepError(failures, rank, "agreeing on what to call", AFTER_A_LIFECYCLE_ERROR)
