"""Graph keys and sizes in words, for the runners' logs (:mod:`graphslot.log`).

A capture run's records are the capture session's (:mod:`.session`); eager fallbacks go
through :class:`graphslot.log.PerReason`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple




def describe_sizes(sizes: Sequence[int]) -> str:
    """``8, 4, 2, 1`` -- at most six shown, then how many more."""
    shown = ", ".join(map(str, sizes[:6]))
    return shown if len(sizes) <= 6 else f"{shown} and {len(sizes) - 6} more"


def describe_keys(keys: Sequence[Tuple[int, Optional[int]]], first: str = "batch size",
                  second: str = "context buckets") -> str:
    """Graph keys in words: decode ``(bs, context bucket or None)``, or (``first="token
    bucket"``, ``second="request slots"``) prefill ``(tokens, requests or None)``."""
    sizes = list(dict.fromkeys(a for a, _ in keys))
    seconds = [b for b in dict.fromkeys(b for _, b in keys) if b is not None]
    text = f"{first}{'s' if len(sizes) > 1 else ''} {describe_sizes(sizes)}"
    return text + (f" x {second} {describe_sizes(seconds)}" if seconds else "")
