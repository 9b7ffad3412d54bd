"""Errors a user of graphslot sees: a :class:`SpecError` carries one :class:`SpecIssue` per
problem (a file is checked completely, not up to its first error); a per-step mismatch
between a batch and the registry is a :class:`SlotError`."""

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
        subject = f" slot '{shorten(self.slot, quote=False)}':" if self.slot else ""
        return f"{where}{subject} {shorten(self.message, MAX_MESSAGE, quote=False)}"


class SpecError(ValueError):
    """A spec (or the params it was built with) is invalid: one ``file:line: slot 'x': message`` line per problem."""

    def __init__(self, issues: Sequence[SpecIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))

    @classmethod
    def at(cls, file: str, line: Optional[int], message: str, slot: Optional[str] = None) -> "SpecError":
        """A SpecError of one issue."""
        return cls([SpecIssue(file, line, message, slot)])


class SlotError(RuntimeError):
    """A batch does not fit the registry (strict mode, adoption, capacity)."""


class ExprError(ValueError):
    """An expression is not valid; wrapped into a SpecIssue with its location."""


MAX_HINT_WORD = 64
MAX_HINT_CANDIDATES = 2000


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """A ``; did you mean 'x'?`` suffix, or an empty string when nothing is close."""
    word = str(word)
    candidates = set(candidates)
    # difflib is quadratic in the lengths: a hint is for typos, not for hostile input.
    if len(word) > MAX_HINT_WORD or len(candidates) > MAX_HINT_CANDIDATES:
        return ""
    close = difflib.get_close_matches(
        word, sorted(c for c in candidates if len(c) <= 2 * MAX_HINT_WORD), n=1, cutoff=0.6
    )
    return f"; did you mean '{close[0]}'?" if close else ""


def one_of(candidates: Iterable[str]) -> str:
    return ", ".join(sorted(candidates))


# Longest value (repr) an error message shows; longer ones end in an ellipsis.
MAX_SHOWN = 80
# Longest message a SpecIssue prints (a safety net behind MAX_SHOWN).
MAX_MESSAGE = 2000


def shorten(value: object, limit: int = MAX_SHOWN, quote: bool = True, *, ascii_only: bool = False) -> str:
    """``repr(value)`` (or ``str`` with ``quote=False``), control characters escaped, cut to
    ``limit`` characters with an ellipsis: untrusted values never make long lines.
    ``ascii_only``: every non-ASCII character escaped too, where a look-alike letter must show."""
    if isinstance(value, str) and len(value) > 4 * limit:
        value = value[: 4 * limit]  # repr and escaping of the rest would be thrown away
    if ascii_only:
        text = ascii(value) if quote else ascii(str(value))[1:-1]
    elif quote:
        text = repr(value)
    else:
        text = str(value)
        text = text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
