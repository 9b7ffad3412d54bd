"""The dispatcher: which captured graph a step replays, across capture modes, or why none.

:class:`Dispatcher` holds the captured keys (:class:`~graphslot.runners.keys.GraphKey`)
of each mode; they are the only record of what can replay: capture adds keys, release
removes them (:meth:`Dispatcher.add`, :meth:`Dispatcher.remove`), nothing else decides.
A step, described before padding (:class:`~graphslot.runners.keys.BatchDescriptor`),
gets a :class:`Dispatch`, in this order (vLLM's ``FULL_AND_PIECEWISE``):

1. ``full``, for a **uniform** batch (a decode step): the smallest key of the step's
   variant whose size holds its requests and whose bucket (None: any) holds its
   context;
2. ``piecewise``, for **any** batch, mixed prefill + decode included: the smallest key
   of its variant whose size holds its tokens and whose bucket (request slots; None:
   any) holds its requests. Attention runs eagerly between the pieces, on the real
   lengths;
3. ``eager``, with a named reason (the constants below, the keys of a runner's
   ``metrics()["eager_reasons"]``).

"Smallest" orders keys by size, then bucket, a key without a bucket (one that serves
every context) after the bucketed ones of its size.
"""

from __future__ import annotations

import bisect
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Set, Tuple

from .keys import BatchDescriptor, GraphKey

#: The capture modes a dispatcher picks among, in the order it tries them.
FULL = "full"
PIECEWISE = "piecewise"
MODES = (FULL, PIECEWISE)
#: What a step runs when no key fits.
EAGER = "eager"

#: Eager reasons.
EMPTY_BATCH = "empty batch"
NO_GRAPHS = "no graphs captured"
NO_GRAPH_OF_VARIANT = "no graph of this variant"
NOT_UNIFORM = "not a uniform decode batch, and no piecewise graph"
MORE_REQUESTS_THAN_FULL = "more requests than the largest full graph"
CONTEXT_BEYOND_BUCKETS = "context longer than the largest context bucket"
MORE_TOKENS_THAN_PIECEWISE = "more tokens than the largest piecewise graph"
MORE_REQUESTS_THAN_SLOTS = "more requests than the piecewise graphs' request slots"


class Dispatch(NamedTuple):
    """What a step runs: ``mode`` (``"full"``, ``"piecewise"`` or ``"eager"``), the key it
    replays (None when eager) and why it runs eager (None when it replays)."""

    mode: str
    key: Optional[GraphKey]
    reason: Optional[str] = None


def _order(key: GraphKey) -> Tuple[int, float]:
    return key.size, float("inf") if key.bucket is None else key.bucket


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; choose one of: {', '.join(MODES)}")


class _Ladder:
    """The keys of one mode and variant, smallest first, with their sizes for a bisect."""

    def __init__(self, keys: Iterable[GraphKey]) -> None:
        self.keys: List[GraphKey] = sorted(keys, key=_order)
        self.sizes = [key.size for key in self.keys]

    def first(self, size: int, bucket_holds) -> Optional[GraphKey]:
        """The smallest key of size ``>= size`` whose bucket ``bucket_holds``."""
        for key in self.keys[bisect.bisect_left(self.sizes, size):]:
            if key.bucket is None or bucket_holds(key.bucket):
                return key
        return None


class Dispatcher:
    """``Dispatcher({"full": keys, "piecewise": keys})``: the captured keys of each mode
    (a mode left out has none); :meth:`dispatch` picks per step."""

    def __init__(self, keys_by_mode: Optional[Mapping[str, Iterable[GraphKey]]] = None) -> None:
        self._keys: Dict[str, Set[GraphKey]] = {mode: set() for mode in MODES}
        self._ladders: Dict[Tuple[str, str], _Ladder] = {}
        for mode, keys in (keys_by_mode or {}).items():
            self.add(mode, *keys)

    # -- the key set ---------------------------------------------------------------
    def add(self, mode: str, *keys: GraphKey) -> None:
        """Record ``keys`` as captured in ``mode``."""
        _check_mode(mode)
        for key in keys:
            key = GraphKey(*key)
            if key.size < 1 or (key.bucket is not None and key.bucket < 1):
                raise ValueError(f"a {mode} graph key needs a size (and a bucket, if any) >= 1, got {key}")
            self._keys[mode].add(key)
        self._reindex(mode, {GraphKey(*key).variant for key in keys})

    def remove(self, mode: str, *keys: GraphKey) -> None:
        """Forget ``keys`` (released); a key not recorded is a KeyError."""
        _check_mode(mode)
        for key in keys:
            self._keys[mode].remove(GraphKey(*key))
        self._reindex(mode, {GraphKey(*key).variant for key in keys})

    def clear(self) -> None:
        """Forget every key (all graphs released): every step runs eager."""
        for mode in MODES:
            self._keys[mode].clear()
        self._ladders.clear()

    def keys(self, mode: str) -> List[GraphKey]:
        """The keys of ``mode``, smallest first."""
        _check_mode(mode)
        return sorted(self._keys[mode], key=lambda k: (k.variant, _order(k)))

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._keys.values())

    def _reindex(self, mode: str, variants: Set[str]) -> None:
        for variant in variants:
            keys = [key for key in self._keys[mode] if key.variant == variant]
            if keys:
                self._ladders[(mode, variant)] = _Ladder(keys)
            else:
                self._ladders.pop((mode, variant), None)

    # -- the pick --------------------------------------------------------------------
    def dispatch(self, desc: BatchDescriptor) -> Dispatch:
        """Full if a full key fits, else piecewise, else eager with the reason."""
        if desc.num_tokens < 1 or desc.num_reqs < 1:
            return Dispatch(EAGER, None, EMPTY_BATCH)
        full = self._ladders.get((FULL, desc.variant))
        if full is not None and desc.uniform:
            context = desc.context
            key = full.first(desc.num_reqs, lambda bucket: context is not None and bucket >= context)
            if key is not None:
                return Dispatch(FULL, key)
        piecewise = self._ladders.get((PIECEWISE, desc.variant))
        if piecewise is not None:
            key = piecewise.first(desc.num_tokens, lambda bucket: bucket >= desc.num_reqs)
            if key is not None:
                return Dispatch(PIECEWISE, key)
        return Dispatch(EAGER, None, self._why_not(desc, full, piecewise))

    def _why_not(self, desc: BatchDescriptor, full: Optional[_Ladder], piecewise: Optional[_Ladder]) -> str:
        """The reason a step no key fits runs eager: the last mode that could have served it."""
        if piecewise is not None:
            return MORE_TOKENS_THAN_PIECEWISE if desc.num_tokens > piecewise.sizes[-1] else MORE_REQUESTS_THAN_SLOTS
        if full is not None and desc.uniform:
            return MORE_REQUESTS_THAN_FULL if desc.num_reqs > full.sizes[-1] else CONTEXT_BEYOND_BUCKETS
        if full is not None:
            return NOT_UNIFORM
        return NO_GRAPH_OF_VARIANT if len(self) else NO_GRAPHS

    def __repr__(self) -> str:
        counts = ", ".join(f"{mode}: {len(self._keys[mode])} keys" for mode in MODES)
        return f"Dispatcher({counts})"
