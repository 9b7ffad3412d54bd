"""What the runners log at capture (:mod:`graphslot.log`): the summary of a capture run.

One INFO record per capture run (:class:`CaptureTimer`), written here once for every
runner; eager fallbacks go through :class:`graphslot.log.PerReason`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Tuple

import torch

from ..spec.budget import human_bytes


def reserved_bytes(device: torch.device) -> Optional[int]:
    """Device memory torch's caching allocator holds on ``device`` (CUDA), else None:
    on the CPU there is no pool to measure."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_reserved(device)


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


class CaptureTimer:
    """Times a capture run and logs its summary: ``with CaptureTimer(...) as t: ...``;
    ``t.seconds`` afterwards. Logs only when the run captured something."""

    def __init__(self, logger: logging.Logger, what: str, keys: str, backend: str, device: torch.device,
                 static_bytes: int):
        self.logger, self.what, self.keys, self.backend, self.device, self.static_bytes = (
            logger, what, keys, backend, device, static_bytes)
        self.seconds = 0.0
        #: Graphs captured (the caller counts): nothing is logged for none.
        self.count = 0

    def __enter__(self) -> "CaptureTimer":
        self._memory = reserved_bytes(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, kind, *_: object) -> None:
        self.seconds = time.perf_counter() - self._start
        if kind is not None or not self.count:
            return
        after = reserved_bytes(self.device)
        memory = "" if after is None else f"; device memory reserved +{human_bytes(max(after - self._memory, 0))}"
        self.logger.info("captured %d %s graph%s (%s), backend %s, in %.2f s; static buffers %s%s",
                         self.count, self.what, "s" if self.count != 1 else "", self.keys, self.backend,
                         self.seconds, human_bytes(self.static_bytes), memory)
