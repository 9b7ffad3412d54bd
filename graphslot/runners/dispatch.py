"""Dispatch: which captured graph a decode step replays, or why it runs eager.

:class:`SizeDispatcher` owns the captured batch sizes and the choice among them, apart
from capture and replay (which :class:`~graphslot.runners.decode.DecodeGraphRunner`
does): a step that needs ``needed`` rows replays the smallest captured size that holds
them (:meth:`~SizeDispatcher.pad`), unless :meth:`~SizeDispatcher.size_problem` or
:meth:`~SizeDispatcher.step_problem` gives a reason to run eager. The DP runner asks the
same dispatcher, with the busiest rank's rows, so every rank picks alike.

The reasons are the keys of ``runner.metrics()["eager_reasons"]``.
"""

from __future__ import annotations

import bisect
from typing import List, Optional, Sequence

from ..planning.planner import default_ladder

#: Eager reasons (``metrics()["eager_reasons"]``).
EMPTY_BATCH = "empty batch"
LARGER_THAN_LARGEST = "larger than the largest graph"
NO_EXACT_SIZE = "no graph of this exact size (padding disabled)"


def other_forward_mode(num_tokens_per_bs: int) -> str:
    """The eager reason of a batch with another count of tokens per request."""
    return f"not {num_tokens_per_bs} token(s) per request (another forward mode)"


def capture_sizes(
    max_bs: int,
    explicit: Optional[Sequence[int]] = None,
    multiple: Optional[int] = None,
    max_requests: Optional[int] = None,
) -> List[int]:
    """Sizes to capture, largest first (so the largest graph sizes the shared pool).

    A default schedule also gets its cap itself, so every batch up to the cap runs;
    sizes beyond the request pool can never be filled and are dropped.
    """
    cap = max_bs if max_requests is None else min(max_bs, max_requests)
    if explicit is None:
        sizes = default_ladder(cap)
    else:
        sizes = [bs for bs in explicit if 1 <= bs <= cap]
    if multiple:
        sizes = [bs for bs in sizes if bs % multiple == 0]
    if not sizes:
        raise ValueError(f"no batch size to capture (max_bs={max_bs}, capture_bs={explicit}, "
                         f"capture_bs_multiple={multiple}, request pool={max_requests})")
    return sorted(set(sizes), reverse=True)


class SizeDispatcher:
    """The captured sizes of a decode runner and the pick among them.

    ``sizes``: the captured batch sizes (any order); ``num_tokens_per_bs``: tokens per
    request of a graph-runnable step (``k`` > 1: speculative target-verify);
    ``disable_padding``: only a step of exactly a captured size runs a graph.
    """

    def __init__(self, sizes: Sequence[int], *, num_tokens_per_bs: int = 1, disable_padding: bool = False):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"captured sizes must be ints >= 1, got {list(sizes)}")
        #: Largest first: capture order (the largest graph sizes the shared pool).
        self.sizes: List[int] = sorted(set(sizes), reverse=True)
        self.k = int(num_tokens_per_bs)
        self.disable_padding = bool(disable_padding)
        self._ascending = self.sizes[::-1]

    @property
    def largest(self) -> int:
        return self.sizes[0]

    def rows_for_tokens(self, num_tokens: int) -> int:
        """Rows (requests) a graph needs to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.k)

    def step_problem(self, raw_bs: int, tokens_per_bs: Optional[int]) -> Optional[str]:
        """Why a batch of ``raw_bs`` requests and ``tokens_per_bs`` tokens each is no
        decode step a graph runs (empty, another forward mode), or None."""
        if raw_bs < 1:
            return EMPTY_BATCH
        if tokens_per_bs != self.k:
            return other_forward_mode(self.k)
        return None

    def size_problem(self, needed: int) -> Optional[str]:
        """Why no captured graph can run ``needed`` rows, or None when one can."""
        if self.disable_padding and needed not in self.sizes:
            return NO_EXACT_SIZE
        if needed > self.sizes[0]:
            return LARGER_THAN_LARGEST
        return None

    def pad(self, needed: int) -> int:
        """The captured size a step of ``needed`` rows replays (``size_problem`` None)."""
        return self._ascending[bisect.bisect_left(self._ascending, needed)]

    def __contains__(self, bs: object) -> bool:
        return bs in self.sizes

    def __repr__(self) -> str:
        return f"SizeDispatcher(sizes={self.sizes}, k={self.k}, disable_padding={self.disable_padding})"
