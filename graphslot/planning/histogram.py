"""The batch sizes a decode runner served: counted per raw size, saved as small JSON.

Pure Python (no torch), so ``graphslot plan-sizes`` reads a histogram without the
runtime. A histogram file comes from users, so :func:`parse_histogram` trusts nothing:
the file is read up to :data:`MAX_FILE_BYTES`, sizes and counts are bounded, and every
problem is one :class:`HistogramError` line naming what was wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..spec.errors import shorten
from ..spec.files import TooLarge, read_bounded, write_atomic

#: ``"format"`` of the file a runner writes.
FORMAT = "graphslot.batch_size_histogram"
VERSION = 1
MAX_FILE_BYTES = 1 << 20
MAX_DISTINCT_SIZES = 2048
MAX_BATCH_SIZE = 1 << 20
MAX_COUNT = 1 << 53  # counts stay exact as floats in the reported figures
#: Longest value an error shows.
SHOWN = 40


class HistogramError(ValueError):
    """A histogram that cannot be planned from; the message is one line."""


class BatchSizeHistogram:
    """How many steps were served at each raw batch size.

    :meth:`record` is one dict update per step (the runner calls it on the replay and
    on the eager path); ``counts`` is the histogram as ``{raw_size: steps}``.
    """

    def __init__(self, counts: Optional[Mapping[int, int]] = None, num_tokens_per_bs: int = 1):
        self.counts: Dict[int, int] = dict(counts or {})
        self.num_tokens_per_bs = num_tokens_per_bs

    def record(self, raw_bs: int) -> None:
        if raw_bs >= 1:
            self.counts[raw_bs] = self.counts.get(raw_bs, 0) + 1

    def clear(self) -> None:
        self.counts.clear()

    @property
    def steps(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> Dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "num_tokens_per_bs": self.num_tokens_per_bs,
                "steps": self.steps, "counts": {str(bs): n for bs, n in sorted(self.counts.items())}}

    def save(self, path: "os.PathLike[str] | str") -> None:
        """Write the histogram as JSON (what ``graphslot plan-sizes`` reads), atomically."""
        write_atomic(Path(path), json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: "os.PathLike[str] | str") -> "BatchSizeHistogram":
        """Read a histogram file; :class:`HistogramError` (one line) when it is not one."""
        try:
            data = read_bounded(path, MAX_FILE_BYTES)
        except TooLarge:
            raise HistogramError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a histogram has at most "
                                 f"{MAX_DISTINCT_SIZES} sizes") from None
        try:
            return parse_histogram(_strict_json(data.decode("utf-8")))
        except (UnicodeDecodeError, RecursionError, ValueError) as exc:  # JSONDecodeError is a ValueError
            if isinstance(exc, HistogramError):
                raise HistogramError(f"{path}: {exc}") from None
            raise HistogramError(f"{path}: not a JSON histogram: "
                                 f"{shorten(str(exc).splitlines()[0], 200, quote=False)}") from None

    def __repr__(self) -> str:
        return f"<BatchSizeHistogram {len(self.counts)} sizes, {self.steps} steps>"


def _unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """A JSON object's members as a dict, refusing a key given twice (``json`` would keep
    the last value silently)."""
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise HistogramError(f"key {shorten(key, SHOWN)} appears twice in one "
                                 "JSON object; JSON readers keep only one of the values: remove the other")
        result[key] = value
    return result


def _strict_json(text: str) -> Any:
    """``json.loads`` for a file from a user: a duplicate key is a HistogramError."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _bounded_int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise HistogramError(f"{what} must be an integer in [{low}, {high}], got {shorten(value, SHOWN)}")
    return value


def _size_key(key: str) -> int:
    if not (key.isascii() and key.isdigit()) or len(key) > 7:
        raise HistogramError(f"a batch size must be a positive integer, got {shorten(key, SHOWN)}")
    return _bounded_int(int(key), 1, MAX_BATCH_SIZE, "a batch size")


def parse_histogram(data: Any) -> BatchSizeHistogram:
    """A runner's dump (an object with ``counts``), or a bare ``{"size": count}`` object."""
    if not isinstance(data, dict):
        raise HistogramError(f"expected a JSON object, got {type(data).__name__}")
    k = 1
    if "counts" in data:
        if data.get("format", FORMAT) != FORMAT:
            raise HistogramError(f"format must be {FORMAT!r}, got {shorten(str(data['format']), SHOWN)}")
        k = _bounded_int(data.get("num_tokens_per_bs", 1), 1, 1 << 16, "num_tokens_per_bs")
        data = data["counts"]
        if not isinstance(data, dict):
            raise HistogramError(f"counts must be an object of size: count, got {type(data).__name__}")
    if len(data) > MAX_DISTINCT_SIZES:
        raise HistogramError(f"{len(data)} distinct batch sizes; at most {MAX_DISTINCT_SIZES}")
    counts: Dict[int, int] = {}
    for key, value in data.items():
        size = _size_key(key)
        if size in counts:
            raise HistogramError(f"batch size {size} is given twice")
        counts[size] = _bounded_int(value, 0, MAX_COUNT, f"the count of batch size {size}")
    counts = {bs: n for bs, n in sorted(counts.items()) if n}
    if not counts:
        raise HistogramError("no batch size was served (every count is 0)")
    if sum(counts.values()) > MAX_COUNT:
        raise HistogramError(f"more than {MAX_COUNT} steps in all")
    return BatchSizeHistogram(counts, k)
