"""What graphslot says while it runs: log records, and progress bars on a terminal.

**Logging.** Standard :mod:`logging`, under the ``graphslot`` logger; each module logs
to its own child (``graphslot.runners.decode``, ``graphslot.runners.prefill``,
``graphslot.runners.guard`` ...), so an engine can set levels per part. The package adds
only a :class:`logging.NullHandler`, as a library should: nothing is printed until the
engine attaches a handler (``logging.getLogger("graphslot").addHandler(...)``, or
``logging.basicConfig``). What is logged:

* INFO, once per capture run: what was captured, on which backend, how long it took,
  the static buffers' bytes and, on CUDA, the device memory the graphs took;
* INFO, an eager fallback with its reason, rate-limited per reason by
  :class:`PerReason` (the first occurrence, then every ``every``-th: by count, so it is
  deterministic);
* WARNING, a replay guard failure (just before its error is raised).

**Progress bars** (:func:`progress_bar`) are drawn only when stderr is a terminal, so CI
logs and captured output never get bar frames; ``show=False`` turns them off anywhere.
Torch-free.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Iterable, Optional

#: The package's logger name; every graphslot logger is a child of it.
LOGGER_NAME = "graphslot"
#: By default an eager reason is logged at its 1st, ``EVERY``-th, ``2 * EVERY``-th ... occurrence.
EVERY = 1000

logging.getLogger(LOGGER_NAME).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``): a child of ``graphslot``."""
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    return logging.getLogger(name)


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``, ``1000th``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class PerReason:
    """Logs an event at its first occurrence per reason, then at every ``every``-th.

    ``log(reason, message)`` counts the reason and, when this occurrence is logged,
    emits ``message`` followed by which occurrence it is. Counting is the only cost of
    an occurrence that is not logged (one dict update); nothing is formatted for it.
    """

    __slots__ = ("logger", "level", "every", "counts")

    def __init__(self, logger: logging.Logger, level: int = logging.INFO, every: int = EVERY):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.logger = logger
        self.level = level
        self.every = every
        self.counts: Dict[str, int] = {}

    def log(self, reason: str, message: str, *args: Any) -> bool:
        """Count ``reason``; log ``message % args`` if this occurrence is one to log.
        Returns whether it was logged (whatever the logger's level)."""
        n = self.counts[reason] = self.counts.get(reason, 0) + 1
        if n != 1 and n % self.every:
            return False
        if self.logger.isEnabledFor(self.level):
            then = (f"first time; logged again at the {ordinal(self.every)}" if n == 1
                    else f"{ordinal(n)} time")
            self.logger.log(self.level, message + " (%s)", *args, then)
        return True


def on_terminal(show: Optional[bool] = None) -> bool:
    """Whether to draw a progress bar: never with ``show=False``; else only when stderr
    is a terminal (``show=True`` or None alike: bar frames in a log are noise)."""
    if show is False:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def progress_bar(iterable: Optional[Iterable[Any]] = None, *, show: Optional[bool] = None, **kwargs: Any) -> Any:
    """A tqdm bar on stderr, disabled unless :func:`on_terminal` (``show``)."""
    from tqdm import tqdm

    return tqdm(iterable, disable=not on_terminal(show), **kwargs)
