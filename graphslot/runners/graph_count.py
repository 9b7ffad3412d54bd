"""No silent explosion: how many graphs a capture asks for, refused past ``max_graphs``.

Keys multiply: decode captures batch sizes x context buckets, prefill ``capture="full"``
token buckets x request slots, and a :class:`~graphslot.runners.model_runner.ModelGraphRunner`
each of those per variant. ``max_num_tokens=8192`` and ``max_bs=64`` under prefill full are
58 x 11 = 638 graphs; a capture past ``max_graphs`` (``GraphRunnerConfig.max_graphs``,
512 by default) is refused before any graph is captured, naming the knobs that make keys.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

#: The knobs that make a phase's keys, by phase (what the error names).
KNOBS = {
    "decode": ("capture_bs", "capture_bs_multiple", "context_buckets"),
    "prefill": ("token_buckets", "request_buckets"),
}


class GraphCountError(ValueError):
    """A capture would make more graphs than ``max_graphs``."""


def describe_count(keys: Iterable[Tuple[int, Optional[int]]], first: str, second: str) -> str:
    """``"58 token buckets x 11 request slots"``: the distinct first and second parts of
    ``keys`` (pairs, the second None when there is none), counted."""
    keys = list(keys)
    firsts = len({a for a, _ in keys})
    seconds = len({b for _, b in keys if b is not None})
    text = f"{firsts} {first}{'s' if firsts != 1 else ''}"
    return text + (f" x {seconds} {second}" if seconds else "")


def check_graph_count(count: int, max_graphs: int, what: str, knobs: Sequence[str], *, lazy_hint: bool = True) -> None:
    """A :class:`GraphCountError` when ``count`` graphs are more than ``max_graphs``:
    ``what`` says which graphs (and how they multiply), ``knobs`` what makes them;
    ``lazy_hint``: suggest ``lazy=True`` too."""
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
    if count > max_graphs:
        lazy = ", lazy=True (only the keys steps use)" if lazy_hint else ""
        raise GraphCountError(f"{what} asks for {count} graphs, more than max_graphs={max_graphs} (none captured): "
                              f"fewer keys ({', '.join(knobs)}){lazy}, or a larger max_graphs")
