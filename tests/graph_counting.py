"""Tests see the graph run: the shipped graph backends (the CPU tape, CUDA) count every
replay of the graphs they captured, whatever the capture mode (a full graph, a breakable
run's segments, a piecewise run's pieces), in ``backend.replays``.

The count is the graphs' own, not the runner's: a runner that runs a step eager while
counting it as a replay (or captures nothing at all) leaves it unchanged. Assert with
:func:`replays_one_step`, or read ``runner.backend.replays``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def replays_one_step(runner: Any) -> Iterator[None]:
    """Asserts that the step run inside replayed at least one captured graph of
    ``runner``'s backend (counted by the graphs, not the runner)."""
    backend = runner.backend
    before = backend.replays
    yield
    assert backend.replays > before, f"the step ran no captured graph of {runner!r}: it ran eager"
