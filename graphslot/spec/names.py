"""Names and text in untrusted input, defined once: identifiers, dotted names, ``module:function``
references, and the characters that make text read differently from what it is. Torch-free."""

from __future__ import annotations

import re
import string
import unicodedata
from typing import Any, Optional

# Names are ASCII identifiers, matched in full (``$`` would let a trailing newline from a
# YAML block scalar through).
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED = re.compile(rf"{IDENTIFIER.pattern}(?:\.{IDENTIFIER.pattern})*")
IMPORT_REFERENCE = re.compile(rf"{DOTTED.pattern}:{DOTTED.pattern}")
IDENTIFIER_CHARS = string.ascii_letters + string.digits + "_"  # for str.lstrip and the like
# Unicode bidirectional controls: they make text read differently from what it is.
BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")


def is_identifier(name: Any) -> bool:
    """An ASCII identifier (``str.isidentifier`` takes any Unicode letter)."""
    return isinstance(name, str) and IDENTIFIER.fullmatch(name) is not None


def control_character(text: str, allow: str = "") -> Optional[str]:
    """The first control (or bidi) character of ``text`` not in ``allow``, else None."""
    if text.isprintable():
        return None
    for c in text:
        if c not in allow and (unicodedata.category(c) in ("Cc", "Cs") or c in BIDI or c in "\u2028\u2029"):
            return c
    return None


def char_name(c: str) -> str:
    """``U+202E``."""
    return f"U+{ord(c):04X}"
