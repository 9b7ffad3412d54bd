"""Errors a user of graphslot sees.

Every spec problem is a :class:`SpecError` carrying one :class:`SpecIssue` per problem
found (a file is checked completely, not only up to its first error). Every per-step
mismatch between a batch and the registry is a :class:`SlotError`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec, with where it is."""

    file: str
    line: Optional[int]
    message: str
    slot: Optional[str] = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:" if self.line is not None else f"{self.file}:"
        subject = f" slot '{self.slot}':" if self.slot else ""
        return f"{where}{subject} {self.message}"


class SpecError(ValueError):
    """A spec (or the params it was built with) is invalid.

    ``str(err)`` is one ``file:line: slot 'x': message`` line per problem.
    """

    def __init__(self, issues: Sequence[SpecIssue]):
        if not issues:
            raise ValueError("SpecError needs at least one issue")
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


class SlotError(RuntimeError):
    """A batch does not fit the registry (strict mode, adoption, capacity)."""


class ExprError(ValueError):
    """An expression is not valid; wrapped into a SpecIssue with its location."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A ``; did you mean 'x'?`` suffix, or an empty string when nothing is close."""
    close = difflib.get_close_matches(str(word), sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def one_of(candidates: Iterable[str]) -> str:
    return ", ".join(sorted(candidates))
