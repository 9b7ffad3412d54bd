"""Dispatch: which captured graph a decode step replays, or why it runs eager.

:class:`SizeDispatcher` owns the captured batch sizes and the choice among them, apart
from capture and replay (which :class:`~graphslot.runners.decode.DecodeGraphRunner`
does): a step that needs ``needed`` rows replays the smallest captured size that holds
them (:meth:`~SizeDispatcher.pad`), unless :meth:`~SizeDispatcher.size_problem` or
:meth:`~SizeDispatcher.step_problem` gives a reason to run eager. The DP runner asks the
same dispatcher, with the busiest rank's rows, so every rank picks alike.

With context buckets (``contexts``) a graph is keyed by ``(batch size, context bucket)``:
a step whose longest context is ``L`` replays the smallest bucket ``>= L``
(:meth:`~SizeDispatcher.pad_context`), or runs eager when ``L`` is beyond the largest
(:meth:`~SizeDispatcher.context_problem`). Attention then costs the bucket, not the
engine's longest possible context: a decode step costs about ``a(bs) + c * bs * L_bucket``
(``a``: weights and everything else per row, ``c``: the K/V gathered and attended per row
and position), so a geometric ladder (:func:`context_ladder`, ratio 2) spends at most 2x,
and on average about 1.44x, the attention term of the exact length.

The reasons are the keys of ``runner.metrics()["eager_reasons"]``.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, List, Optional, Sequence, Tuple, Union

from ..planning.planner import default_ladder

#: Eager reasons (``metrics()["eager_reasons"]``).
EMPTY_BATCH = "empty batch"
LARGER_THAN_LARGEST = "larger than the largest graph"
NO_EXACT_SIZE = "no graph of this exact size (padding disabled)"
LONGER_THAN_LARGEST_CONTEXT = "context longer than the largest context bucket"

#: The smallest bucket of the ``"auto"`` ladder.
AUTO_SMALLEST_CONTEXT = 128


def other_forward_mode(num_tokens_per_bs: int) -> str:
    """The eager reason of a batch with another count of tokens per request."""
    return f"not {num_tokens_per_bs} token(s) per request (another forward mode)"


def positive_ints(where: str, values: Any) -> List[int]:
    """``values`` (a sequence) as ints, each checked: a TypeError naming ``where`` and the
    value for one that is not an int (a float, a bool, a string), a ValueError for one
    below 1. Order and duplicates are kept."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{where} must be a sequence of ints, got {type(values).__name__} {values!r}")
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{where} must be a sequence of ints, got {type(values).__name__} {values!r}") from None
    for value in items:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(f"{where} must hold ints, got {value!r} ({type(value).__name__}) in {items!r}")
    ints = [operator.index(value) for value in items]
    for value in ints:
        if value < 1:
            raise ValueError(f"{where} must be ints >= 1, got {value} in {ints}")
    return ints


def capture_sizes(
    max_bs: int,
    explicit: Optional[Sequence[int]] = None,
    multiple: Optional[int] = None,
    max_requests: Optional[int] = None,
    *,
    name: str = "capture_bs",
) -> List[int]:
    """Sizes to capture, largest first (so the largest graph sizes the shared pool),
    duplicates merged.

    A default schedule also gets its cap itself, so every batch up to the cap runs.
    Explicit sizes (``name``: the argument they came from, for errors) must be ints from
    1 to ``max_bs`` (a TypeError or ValueError naming the value otherwise); those beyond
    the request pool can never be filled and are dropped.
    """
    cap = max_bs if max_requests is None else min(max_bs, max_requests)
    if explicit is None:
        sizes = default_ladder(cap)
    else:
        sizes = positive_ints(name, explicit)
        beyond = [bs for bs in sizes if bs > max_bs]
        if beyond:
            raise ValueError(f"{name} {sizes}: {beyond[0]} is beyond max_bs {max_bs} (no batch that large runs a "
                             f"graph): drop it, or raise max_bs")
        sizes = [bs for bs in sizes if bs <= cap]
    if multiple:
        sizes = [bs for bs in sizes if bs % multiple == 0]
    if not sizes:
        raise ValueError(f"no batch size to capture (max_bs={max_bs}, capture_bs={explicit}, "
                         f"capture_bs_multiple={multiple}, request pool={max_requests})")
    return sorted(set(sizes), reverse=True)


def context_ladder(buckets: Union[None, str, Sequence[int]], max_context_len: Optional[int]) -> Optional[List[int]]:
    """The context buckets a runner captures, largest first; None: no buckets (one
    implicit bucket, graphs keyed by batch size alone).

    ``"auto"``: ``AUTO_SMALLEST_CONTEXT``, twice that, ... below ``max_context_len``, and
    ``max_context_len`` itself (the adapter's, which ``"auto"`` needs). A sequence: those
    lengths, each an int from 1 to ``max_context_len`` (when the adapter says it); a step
    longer than the largest runs eager.
    """
    if buckets is None:
        return None
    where = "context_buckets"
    if isinstance(buckets, str):
        if buckets != "auto":
            raise ValueError(f"{where} must be None, 'auto' or a sequence of lengths, got {buckets!r}")
        if max_context_len is None:
            raise ValueError(f"{where}='auto' needs the adapter's max_context_len (DecodeAdapter.max_context_len is "
                             "None): give the lengths explicitly, or have the adapter say its longest context")
        ladder = []
        n = AUTO_SMALLEST_CONTEXT
        while n < max_context_len:
            ladder.append(n)
            n *= 2
        return sorted(set(ladder + [max_context_len]), reverse=True)
    try:
        values = list(buckets)
    except TypeError:
        raise TypeError(f"{where} must be None, 'auto' or a sequence of lengths, "
                        f"got {type(buckets).__name__}") from None
    try:
        if any(isinstance(v, bool) for v in values):
            raise TypeError
        lengths = [operator.index(v) for v in values]
    except TypeError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{where} must be ints >= 1 (at least one), got {values!r}")
    if max_context_len is not None and max(lengths) > max_context_len:
        raise ValueError(f"{where} {sorted(set(lengths))}: {max(lengths)} is beyond the adapter's max_context_len "
                         f"{max_context_len}, which no request can reach")
    return sorted(set(lengths), reverse=True)


class SizeDispatcher:
    """The captured sizes (and context buckets) of a decode runner and the pick among them.

    ``sizes``: the captured batch sizes (any order); ``num_tokens_per_bs``: tokens per
    request of a graph-runnable step (``k`` > 1: speculative target-verify);
    ``disable_padding``: only a step of exactly a captured size runs a graph;
    ``contexts``: the context buckets (any order), or None for none.
    """

    def __init__(self, sizes: Sequence[int], *, num_tokens_per_bs: int = 1, disable_padding: bool = False,
                 contexts: Optional[Sequence[int]] = None):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"captured sizes must be ints >= 1, got {list(sizes)}")
        if contexts is not None and (not contexts or min(contexts) < 1):
            raise ValueError(f"context buckets must be ints >= 1, got {list(contexts)}")
        #: Largest first: capture order (the largest graph sizes the shared pool).
        self.sizes: List[int] = sorted(set(sizes), reverse=True)
        self.k = int(num_tokens_per_bs)
        self.disable_padding = bool(disable_padding)
        self._ascending = self.sizes[::-1]
        #: The context buckets, largest first; None: no buckets.
        self.contexts: Optional[List[int]] = None if contexts is None else sorted(set(contexts), reverse=True)
        self._contexts_ascending = None if contexts is None else self.contexts[::-1]

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

    def context_problem(self, longest: int) -> Optional[str]:
        """Why no context bucket holds a step whose longest context is ``longest``, or None."""
        if self.contexts is not None and longest > self.contexts[0]:
            return LONGER_THAN_LARGEST_CONTEXT
        return None

    def pad_context(self, longest: int) -> Optional[int]:
        """The bucket a step whose longest context is ``longest`` replays (``context_problem``
        None); None without buckets. A bisect over the ladder."""
        if self._contexts_ascending is None:
            return None
        return self._contexts_ascending[bisect.bisect_left(self._contexts_ascending, longest)]

    def keys(self) -> List[Tuple[int, Optional[int]]]:
        """Every ``(batch size, context bucket)`` a runner captures, in capture order: largest
        first over both (the batch size, then the bucket); the bucket is None without buckets."""
        return [(bs, context) for bs in self.sizes for context in (self.contexts or [None])]

    def __contains__(self, bs: object) -> bool:
        return bs in self.sizes

    def __repr__(self) -> str:
        contexts = "" if self.contexts is None else f", contexts={self.contexts}"
        return f"SizeDispatcher(sizes={self.sizes}, k={self.k}, disable_padding={self.disable_padding}{contexts})"
