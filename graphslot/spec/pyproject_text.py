"""pyproject.toml as untrusted text: read it (bounded), parse it (refusing what would make
the TOML parser superlinear), and find the lines of its keys by scanning it.

pyproject.toml arrives in pull requests like spec files do, and tomllib reports no
locations (tomlkit's document keeps them, but it is quadratic on hostile input: see
:mod:`.pyproject_edit`), so every error names ``pyproject.toml:LINE`` from a scan of the text. Every
scan is linear in the text's length: the file is read up to MAX_PYPROJECT_BYTES, and a
key of more than MAX_KEY_PARTS dotted parts (quadratic in tomllib) or nesting that
would overflow its recursion is an error with the line. The one import of ``tomllib``
(``tomli`` on Python 3.10) is here. Torch-free.
"""

from __future__ import annotations

import re
from functools import cached_property
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


def pyproject_label(path: Optional[Path]) -> str:
    """How errors name a pyproject.toml: as the user would type it."""
    return PYPROJECT if path is None else display_path(path)


class ProjectConfigError(ValueError):
    """pyproject.toml cannot be read, or its ``[tool.graphslot]`` table is malformed.

    ``str(err)`` is one ``pyproject.toml:LINE: message`` line per problem (the line
    left out where it cannot be found); ``issues`` holds them as :class:`SpecIssue`.
    """

    def __init__(self, issues: Union[str, Sequence[SpecIssue]]):
        if isinstance(issues, str):
            issues = [SpecIssue(PYPROJECT, None, issues)]
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


# --- locations -------------------------------------------------------------------------
#
# pyproject.toml is untrusted text, so every scan of it is linear in its length: string
# methods, and regular expressions whose repeated parts cannot match the same text two
# ways (overlapping quantifiers backtrack polynomially: the old header pattern took two
# minutes on a line of "[" and 4 KB of spaces).

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def table_header(line: str) -> Optional[Tuple[bool, str]]:
    """``(is_array, dotted name)`` of a table header line such as ``[tool.graphslot]`` or
    ``[[ tool . "graphslot" . outputs ]]  # comment`` (quotes dropped, spaces around dots
    removed); None for any other line. ``line`` holds no newline."""
    body = line.strip(" \t")
    if not body.startswith("["):
        return None
    is_array = body.startswith("[[")
    body = body[2 if is_array else 1:]
    close = body.find("]")
    if close < 0:
        return None
    name, rest = body[:close], body[close + 1:]
    if is_array:
        if not rest.startswith("]"):
            return None
        rest = rest[1:]
    rest = rest.lstrip(" \t")
    if rest and not rest.startswith("#"):
        return None
    name = ".".join(part.strip(" \t") for part in name.split("."))
    return is_array, name.replace('"', "").replace("'", "")


def line_key(line: str) -> Optional[Tuple[str, int]]:
    """``(key, offset of the value)`` of a ``key = value`` line whose key is one bare or
    quoted part (``specs = [...]``, ``"specs" = [...]``); None for any other line. The
    offset is past the ``=`` and the spaces after it."""
    stripped = line.lstrip(" \t")
    if stripped[:1] in ("'", '"'):
        end = stripped.find(stripped[0], 1)
        if end < 0:
            return None
        key, rest = stripped[1:end], stripped[end + 1:]
    else:
        match = _BARE_KEY.match(stripped)
        if match is None:
            return None
        key, rest = match.group(0), stripped[match.end():]
    rest = rest.lstrip(" \t")
    if not rest.startswith("="):
        return None
    return key, len(line) - len(rest[1:].lstrip(" \t"))


class Locator:
    """Line numbers of keys in the text of a pyproject.toml, found by scanning it.

    Only the common layouts are understood (``[tool.graphslot]`` and
    ``[[tool.graphslot.outputs]]`` headers, ``key = ...`` lines under them); anything
    else gives ``None`` and the error names the file alone. The text is scanned once,
    on the first question, into an index: any number of questions stays linear.
    """

    def __init__(self, text: str):
        self.text = text

    @cached_property
    def _index(self) -> Tuple[Dict[str, List[int]], Dict[int, Dict[str, int]]]:
        """(header name -> its 0-based lines, header line -> {key: 1-based line under it})."""
        sections: Dict[str, List[int]] = {}
        keys: Dict[int, Dict[str, int]] = {}
        current: Optional[Dict[str, int]] = None
        for i, line in enumerate(self.text.splitlines()):
            header = table_header(line)
            if header is not None:
                sections.setdefault(header[1], []).append(i)
                current = keys[i] = {}
            elif current is not None:
                found = line_key(line)
                if found is not None:
                    current.setdefault(found[0], i + 1)
        return sections, keys

    def _sections(self, name: str) -> List[int]:
        return self._index[0].get(name, [])

    def _key_in(self, start: Optional[int], key: str) -> Optional[int]:
        return None if start is None else self._index[1][start].get(key)

    def table(self, key: Optional[str] = None) -> Optional[int]:
        sections = self._sections("tool.graphslot")
        start = sections[0] if sections else None
        if key is None:
            return None if start is None else start + 1
        return self._key_in(start, key)

    def output(self, index: int, key: Optional[str] = None) -> Optional[int]:
        sections = self._sections("tool.graphslot.outputs")
        if index >= len(sections):
            return self.table("outputs") if key is None else None
        if key is None:
            return sections[index] + 1
        return self._key_in(sections[index], key) or sections[index] + 1


# --- reading ---------------------------------------------------------------------------

_SPACES = re.compile(r"[ \t]*")
_KEY_PART = re.compile(r"""[A-Za-z0-9_-]+|"[^"\\]*(?:\\.[^"\\]*)*"|'[^']*'""")  # bare, "basic", 'literal'
_KEY_STARTS = re.compile(r"[{,]")


def _key_parts(line: str, i: int) -> int:
    """The parts of the dotted key at ``line[i:]`` (0: no key there), counted up to one
    more than MAX_KEY_PARTS."""
    parts = 0
    while parts <= MAX_KEY_PARTS:
        part = _KEY_PART.match(line, _SPACES.match(line, i).end())
        if part is None:
            return parts
        parts += 1
        i = _SPACES.match(line, part.end()).end()
        if not line.startswith(".", i):
            return parts
        i += 1
    return parts


def long_key_line(text: str) -> Optional[int]:
    """The first line (1-based) where a key of more than MAX_KEY_PARTS dotted parts may
    start, else None. tomllib takes time and memory quadratic in the parts of a key (a
    160 KB line of ``a.a.a…= 1`` exhausts memory), so the text is checked before it is
    parsed: at the start of each line (after ``[`` or ``[[``) and after each ``{`` and
    ``,``, wherever TOML can have a key. A line with fewer dots holds no such key."""
    for number, line in enumerate(text.split("\n"), 1):
        if line.count(".") < MAX_KEY_PARTS:
            continue
        first = _SPACES.match(line).end()
        first += 2 if line.startswith("[[", first) else 1 if line.startswith("[", first) else 0
        starts = [first] + [m.end() for m in _KEY_STARTS.finditer(line)]
        if any(_key_parts(line, i) > MAX_KEY_PARTS for i in starts):
            return number
    return None


def _toml_error(exc: Exception) -> Tuple[Optional[int], str]:
    """(line, message) of a TOMLDecodeError, whose text ends in "(at line L, column C)"."""
    message, sep, where = str(exc).rpartition(" (at line ")
    if not sep:
        return None, str(exc)
    line = where.partition(",")[0]
    return (int(line) if line.isdigit() else None), message


def read_pyproject(path: Path) -> bytes:
    """The bytes of ``path``, at most MAX_PYPROJECT_BYTES (ProjectConfigError otherwise)."""
    file = pyproject_label(path)
    try:
        return read_bounded(path, MAX_PYPROJECT_BYTES)
    except OSError as exc:
        raise ProjectConfigError([SpecIssue(file, None, f"cannot read: {exc.strerror or exc}")]) from None
    except TooLarge as exc:
        raise ProjectConfigError([SpecIssue(file, None, f"{exc}; a pyproject.toml is a few KiB")]) from None


def read_toml(path: Path, data: bytes) -> Tuple[str, Dict[str, Any]]:
    """The text and the document of ``data``, the bytes of the pyproject.toml at ``path``
    (ProjectConfigError with the line where they cannot be read)."""
    file = pyproject_label(path)

    def error(line: Optional[int], message: str) -> ProjectConfigError:
        return ProjectConfigError([SpecIssue(file, line, message)])

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(data.count(b"\n", 0, exc.start) + 1, "is not valid UTF-8") from None
    if text.startswith("\ufeff"):
        # YAML allows a byte-order mark (a spec may start with one); TOML does not, and
        # tomllib, which pip and build read pyproject.toml with, refuses it.
        raise error(1, "starts with a UTF-8 byte-order mark, which TOML does not allow (tomllib, and so pip, "
                       "refuse it); save it without one")
    long_key = long_key_line(text)
    if long_key is not None:
        raise error(long_key, f"a dotted key of more than {MAX_KEY_PARTS} parts: TOML parsers take time and "
                              "memory quadratic in them, so graphslot does not read the file")
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, message = _toml_error(exc)
        raise error(line, f"not valid TOML: {message}") from None
    except RecursionError:
        raise error(None, "not valid TOML: arrays or inline tables nested too deeply") from None


def lines_with_offsets(text: str) -> List[Tuple[int, str]]:
    """``(offset, line)`` for every line, the line without its newline (nor a CR before it)."""
    result, offset = [], 0
    for line in text.split("\n"):
        result.append((offset, line.removesuffix("\r")))
        offset += len(line) + 1
    return result
