"""pyproject.toml as untrusted text: read it (bounded), parse it (refusing what makes tomllib superlinear), find
the lines of its keys (tomllib reports none). Every scan is linear: no regular expression whose repeated parts can
match the same text two ways (an old header pattern took two minutes on a line of "[" and 4 KB of spaces)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .errors import SpecIssue
from .files import TooLarge, display_path, read_bounded

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as the tomli package (declared for it)
    import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = "pyproject.toml"
# Largest pyproject.toml read (a real one is a few KiB).
MAX_PYPROJECT_BYTES = 1 << 20
# Most parts a dotted key may have (``a.b.c`` has 3; see long_key_line).
MAX_KEY_PARTS = 128

_HEADER = re.compile(r"[ \t]*(?:\[\[([^\]]*)\]\]|\[(?!\[)([^\]]*)\])[ \t]*(?:#.*)?\Z")  # [[array]] or [table]
_LINE_KEY = re.compile(r"""[ \t]*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))[ \t]*=[ \t]*""")
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"\\]*(?:\\.[^"\\]*)*"|'[^']*')"""  # bare, "basic", 'literal'
# A key of more than MAX_KEY_PARTS parts; its parts cannot match the same text two ways, so matching is linear.
_LONG_KEY = re.compile(rf"[ \t]*(?:{_KEY_PART}[ \t]*\.[ \t]*){{{MAX_KEY_PARTS}}}{_KEY_PART}")
_LINE_START = re.compile(r"[ \t]*\[{0,2}")
_KEY_STARTS = re.compile(r"[{,]")


def pyproject_label(path: Optional[Path]) -> str:
    """How errors name a pyproject.toml: as the user would type it."""
    return PYPROJECT if path is None else display_path(path)


class ProjectConfigError(ValueError):
    """pyproject.toml cannot be read, or its ``[tool.graphslot]`` table is malformed: ``str(err)`` is one
    ``pyproject.toml:LINE: message`` line per problem; ``issues`` holds them. A message alone is one issue."""

    def __init__(self, issues: Union[str, Sequence[SpecIssue]], line: Optional[int] = None, file: str = PYPROJECT):
        self.issues = [SpecIssue(file, line, issues)] if isinstance(issues, str) else list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def table_header(line: str) -> Optional[Tuple[bool, str]]:
    """``(is_array, dotted name)`` of a header line such as ``[[ tool . "graphslot" . outputs ]]  # comment``
    (quotes dropped, spaces around dots removed); None for any other line. ``line`` holds no newline."""
    match = _HEADER.match(line)
    if match is None:
        return None
    name = ".".join(part.strip(" \t") for part in (match.group(1) or match.group(2) or "").split("."))
    return match.group(1) is not None, name.replace('"', "").replace("'", "")


def line_key(line: str) -> Optional[Tuple[str, int]]:
    """``(key, offset of the value)`` of a ``key = value`` line whose key is one bare or quoted part (None for any
    other line); the offset is past the ``=`` and the spaces after it."""
    match = _LINE_KEY.match(line)
    return None if match is None else (match.group(match.lastindex), match.end())


class Locator:
    """Lines (1-based) of the ``key = ...`` lines under the ``[tool.graphslot]`` and ``[[tool.graphslot.outputs]]``
    headers, from one scan of the text; other layouts give None (the error then names the file alone)."""

    def __init__(self, text: str):
        self.sections: Dict[str, List[int]] = {}  # header name -> the lines it is on
        self.keys: Dict[int, Dict[str, int]] = {}  # header line -> {key: line under it}
        current: Optional[Dict[str, int]] = None
        for n, line in enumerate(text.splitlines(), 1):
            header = table_header(line)
            if header is not None:
                self.sections.setdefault(header[1], []).append(n)
                current = self.keys[n] = {}
            elif current is not None and (found := line_key(line)):
                current.setdefault(found[0], n)

    def table(self, key: Optional[str] = None) -> Optional[int]:
        start = next(iter(self.sections.get("tool.graphslot", ())), None)
        return start if start is None or key is None else self.keys[start].get(key)

    def output(self, index: int, key: Optional[str] = None) -> Optional[int]:
        sections = self.sections.get("tool.graphslot.outputs", [])
        if index >= len(sections):
            return None if key else self.table("outputs")
        return self.keys[sections[index]].get(key) or sections[index]


def long_key_line(text: str) -> Optional[int]:
    """The first line where a key of more than MAX_KEY_PARTS dotted parts may start, else None. tomllib takes
    time and memory quadratic in the parts of a key (a 160 KB line of ``a.a.a…= 1`` exhausts memory), so keys are
    counted before parsing wherever TOML can have one: at the start of a line (after ``[`` or ``[[``) and after
    each ``{`` and ``,``. A line with fewer dots holds no such key."""
    for number, line in enumerate(text.split("\n"), 1):
        if line.count(".") < MAX_KEY_PARTS:
            continue
        starts = [_LINE_START.match(line).end(), *(m.end() for m in _KEY_STARTS.finditer(line))]
        if any(_LONG_KEY.match(line, i) for i in starts):
            return number
    return None


def read_pyproject(path: Path) -> bytes:
    """The bytes of ``path``, at most MAX_PYPROJECT_BYTES (ProjectConfigError otherwise)."""
    try:
        return read_bounded(path, MAX_PYPROJECT_BYTES)
    except OSError as exc:
        raise ProjectConfigError(f"cannot read: {exc.strerror or exc}", None, pyproject_label(path)) from None
    except TooLarge as exc:
        raise ProjectConfigError(f"{exc}; a pyproject.toml is a few KiB", None, pyproject_label(path)) from None


def read_toml(path: Path, data: bytes) -> Tuple[str, Dict[str, Any]]:
    """The text and the document of ``data``, the bytes of the pyproject.toml at ``path`` (ProjectConfigError
    with the line where they cannot be read)."""
    file = pyproject_label(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProjectConfigError("is not valid UTF-8", data.count(b"\n", 0, exc.start) + 1, file) from None
    if text.startswith("\ufeff"):
        # YAML allows a byte-order mark (a spec may start with one); TOML does not, nor tomllib, nor so pip.
        message = "starts with a UTF-8 byte-order mark, which TOML does not allow (tomllib, and so pip, refuse it)"
        raise ProjectConfigError(message + "; save it without one", 1, file)
    long_key = long_key_line(text)
    if long_key is not None:
        message = f"a dotted key of more than {MAX_KEY_PARTS} parts: TOML parsers take time and memory quadratic"
        raise ProjectConfigError(message + " in them, so graphslot does not read the file", long_key, file)
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its text ends in "(at line L, column C)"
        message, sep, at = str(exc).rpartition(" (at line ")
        line = at.partition(",")[0]
        line = int(line) if sep and line.isdigit() else None
        raise ProjectConfigError(f"not valid TOML: {message if sep else exc}", line, file) from None
    except RecursionError:
        raise ProjectConfigError("not valid TOML: arrays or inline tables nested too deeply", None, file) from None


def lines_with_offsets(text: str) -> List[Tuple[int, str]]:
    """``(offset, line)`` for every line, the line without its newline (nor a CR before it)."""
    result = []
    offset = 0
    for line in text.split("\n"):
        result.append((offset, line.removesuffix("\r")))
        offset += len(line) + 1
    return result
