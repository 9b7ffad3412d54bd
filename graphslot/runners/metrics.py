"""Per-step counters of a graph runner: what replayed, how much padding, what ran eager,
and the raw batch sizes served (the histogram ``graphslot plan-sizes`` plans from).

Plain integer bumps on the replay path (no tensors, no syncs); :meth:`as_dict` is the
API (``runner.metrics()``), JSON-ready.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Optional

from ..planning.histogram import BatchSizeHistogram


class RunnerMetrics:
    """Replays per captured size, padded rows, eager fallbacks by reason; in
    :attr:`histogram`, every step's *needed* size: the rows a graph must have, which is
    the raw size, or with DP attention the busiest rank's (what sizes a plan).
    ``contexts``: the runner has context buckets, so replays are counted per bucket too."""

    __slots__ = ("replays", "raw_rows", "padded_rows", "eager", "histogram", "contexts")

    def __init__(self, num_tokens_per_bs: int = 1, contexts: bool = False) -> None:
        self.replays: Counter = Counter()  # captured size -> replays
        self.contexts: Optional[Counter] = Counter() if contexts else None  # context bucket -> replays
        self.raw_rows = 0
        self.padded_rows = 0  # rows computed only to fill a graph: padded - raw, summed
        self.eager: Counter = Counter()  # reason -> eager steps
        self.histogram = BatchSizeHistogram(num_tokens_per_bs=num_tokens_per_bs)

    def replayed(self, raw: int, padded: int, needed: int, context: Optional[int] = None) -> None:
        self.replays[padded] += 1
        if context is not None:
            self.contexts[context] += 1
        self.raw_rows += raw
        self.padded_rows += padded - raw
        self.histogram.record(needed)

    def fell_back(self, reason: str, needed: Optional[int]) -> None:
        """``needed`` None: not a decode step (a prefill), so not a size to plan for."""
        self.eager[reason] += 1
        if needed is not None:
            self.histogram.record(needed)

    def reset(self) -> None:
        self.__init__(self.histogram.num_tokens_per_bs, self.contexts is not None)

    def as_dict(self) -> Dict[str, Any]:
        replays = sum(self.replays.values())
        rows = self.raw_rows + self.padded_rows
        per_context = {} if self.contexts is None else {
            "replays_per_context": {str(length): n for length, n in sorted(self.contexts.items())}}
        return {
            "replays": replays,
            "replays_per_size": {str(bs): n for bs, n in sorted(self.replays.items())},
            **per_context,
            "raw_rows": self.raw_rows,
            "padded_rows": self.padded_rows,
            "padding_fraction": self.padded_rows / rows if rows else 0.0,
            "eager_fallbacks": sum(self.eager.values()),
            "eager_reasons": dict(self.eager.most_common()),
        }
