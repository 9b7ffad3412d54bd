"""Adding a path to ``[tool.graphslot] specs`` in a pyproject.toml, edited as text.

There is no TOML writer in the standard library, and rewriting the file would lose the
user's layout and comments, so the edit is minimal: the entry goes into the existing
``specs`` array (on its own line when the array has one entry per line, else after the
last entry), as a new ``specs`` key under the table's header, or as a new table. The
edit is accepted only when the edited text parses to the old document plus the new path
at the end of ``specs`` (:func:`verify_addition`); otherwise :class:`CannotEdit` says
why and the file is left alone. Every scan is linear in the text. Torch-free.

No library does this for untrusted text, as measured: tomlkit (0.15.2) keeps the layout too,
but takes time quadratic in the dotted keys sharing a prefix (80 five-part keys, 1.5 KB:
3.7 s; python-poetry/tomlkit#479), and tomllib and tomli write nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .project import TABLE, validate_table
from .pyproject_text import line_key, lines_with_offsets, table_header, tomllib


class CannotEdit(Exception):
    """pyproject.toml cannot be edited safely; ``str()`` says why (one line)."""


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (control characters were refused before)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _indent(line: str) -> str:
    """The spaces and tabs ``line`` starts with."""
    return line[:len(line) - len(line.lstrip(" \t"))]


def _skip_blank(text: str, i: int) -> int:
    """Past whitespace, newlines and comments."""
    while i < len(text):
        if text[i] in " \t\r\n":
            i += 1
        elif text[i] == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        else:
            break
    return i


def _string_end(text: str, i: int) -> int:
    """The offset just past the TOML string starting at ``text[i]`` (a quote)."""
    quote = text[i]
    multi = text.startswith(quote * 3, i)
    j = i + (3 if multi else 1)
    while j < len(text):
        c = text[j]
        if c == "\\" and quote == '"':
            j += 2
            continue
        if c == "\n" and not multi:
            break
        if c == quote:
            if not multi:
                return j + 1
            if text.startswith(quote * 3, j):
                k = j
                while k < len(text) and text[k] == quote and k - j < 5:  # """"" ends with 2 quotes inside
                    k += 1
                return k
        j += 1
    raise CannotEdit("a string in its specs array does not end")


@dataclass
class ArrayLayout:
    open: int  # offset of [
    close: int  # offset of ]
    elements: List[Tuple[int, int]] = field(default_factory=list)  # (start, end) of each string
    comma: Optional[int] = None  # offset of a comma after the last element


def scan_array(text: str, i: int) -> ArrayLayout:
    """The layout of the array of strings starting at ``text[i]`` (``[``)."""
    layout = ArrayLayout(open=i, close=-1)
    i += 1
    while True:
        i = _skip_blank(text, i)
        if i >= len(text):
            raise CannotEdit("its specs array does not end")
        c = text[i]
        if c == "]":
            layout.close = i
            return layout
        if c == "," and layout.elements and layout.comma is None:
            layout.comma, i = i, i + 1
        elif c in "\"'" and (not layout.elements or layout.comma is not None):
            end = _string_end(text, i)
            layout.elements.append((i, end))
            layout.comma, i = None, end
        else:
            raise CannotEdit("its specs array is not a plain list of strings")


def _indent_of(text: str, pos: int) -> Optional[str]:
    """The whitespace before ``pos`` on its line, when only whitespace precedes it."""
    start = text.rfind("\n", 0, pos) + 1
    before = text[start:pos]
    return before if not before.strip() else None


def _insert_into_array(text: str, layout: ArrayLayout, item: str, key_indent: str, nl: str) -> str:
    close_line = text.rfind("\n", 0, layout.close) + 1
    multi_line = close_line > layout.open and not text[close_line:layout.close].strip()
    if multi_line:  # ] on a line of its own: the new entry goes on a new line above it
        indent = None
        for start, _ in (layout.elements[-1:] + layout.elements[:1]):
            indent = _indent_of(text, start)
            if indent is not None:
                break
        if indent is None:
            inside = [line for _, line in lines_with_offsets(text[layout.open:close_line])[1:] if line.strip()]
            indent = _indent(inside[-1]) if inside else key_indent + "    "
        trailing = layout.comma is not None or not layout.elements
        new_line = indent + item + ("," if trailing else "") + nl
        text = text[:close_line] + new_line + text[close_line:]
        if layout.elements and layout.comma is None:
            end = layout.elements[-1][1]
            text = text[:end] + "," + text[end:]
        return text
    if not layout.elements:
        if text[layout.open + 1:layout.close].strip():
            raise CannotEdit("its specs array is not a plain list of strings")
        return text[:layout.open + 1] + item + text[layout.close:]
    if layout.comma is None:
        end = layout.elements[-1][1]
        return text[:end] + ", " + item + text[end:]
    return text[:layout.comma + 1] + " " + item + "," + text[layout.comma + 1:]


def add_spec_entry(text: str, entry: str) -> str:
    """``text`` (a pyproject.toml) with ``entry`` appended to ``[tool.graphslot] specs``:
    into the existing array, as a new ``specs`` key under the table's header, or as a
    new table. Only the text around the insertion changes; the result is not verified
    here (see :func:`verify_addition`). CannotEdit where the layout is not one handled."""
    nl = "\r\n" if "\r\n" in text else "\n"
    item = toml_string(entry)
    lines = lines_with_offsets(text)
    headers = [(n, table_header(line)) for n, (_, line) in enumerate(lines)]
    headers = [(n, h) for n, h in headers if h is not None]
    table = [n for n, (is_array, name) in headers if name == "tool.graphslot" and not is_array]
    if not table:
        block = f"[tool.graphslot]{nl}specs = [{item}]{nl}"
        outputs = [n for n, (is_array, name) in headers if name == "tool.graphslot.outputs" and is_array]
        if outputs:  # before the first output entry and the comment lines right above it
            n = outputs[0]
            while n > 0 and lines[n - 1][1].lstrip().startswith("#"):
                n -= 1
            offset = lines[n][0]
            return text[:offset] + block + nl + text[offset:]
        if text and not text.endswith("\n"):
            text += nl
        if text.strip() and not text.endswith(nl + nl):
            text += nl
        return text + block
    start = table[0]
    end = next((n for n, _ in headers if n > start), len(lines))
    for n in range(start + 1, end):
        offset, line = lines[n]
        key = line_key(line)
        if key is not None and key[0] == "specs":
            value = offset + key[1]
            if not text.startswith("[", value):
                raise CannotEdit("its specs value is not written as an array [...]")
            layout = scan_array(text, value)
            return _insert_into_array(text, layout, item, _indent(line), nl)
    if start + 1 >= len(lines):  # the header is the last line and has no newline
        return text + nl + f"specs = [{item}]{nl}"
    offset = lines[start + 1][0]
    return text[:offset] + f"specs = [{item}]{nl}" + text[offset:]


def _parsed(text: str) -> Dict[str, Any]:
    # Floats as their text: a nan anywhere must not make two equal documents differ.
    return tomllib.loads(text, parse_float=str)


def verify_addition(old_text: str, new_text: str, entry: str) -> None:
    """CannotEdit unless ``new_text`` parses to ``old_text``'s document with ``entry``
    appended to ``[tool.graphslot] specs`` (created if need be) and nothing else."""
    try:
        new = _parsed(new_text)
    except tomllib.TOMLDecodeError:
        raise CannotEdit("its layout is not one graphslot can edit safely (the edit would not be "
                         "valid TOML)") from None
    expected = copy.deepcopy(_parsed(old_text))
    tool = expected.setdefault("tool", {})
    table = tool.setdefault("graphslot", {}) if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        raise CannotEdit(f"its {TABLE} is not a table")
    specs = table.get("specs", [])
    table["specs"] = (list(specs) if isinstance(specs, list) else [specs]) + [entry]
    if new != expected:
        raise CannotEdit("its layout is not one graphslot can edit safely (the edit would change more "
                          "than the specs list)")
    validate_table(new["tool"]["graphslot"], new_text)


def pyproject_with_entry(old_text: str, entry: str) -> str:
    """The edited, verified text (CannotEdit otherwise)."""
    new_text = add_spec_entry(old_text, entry)
    verify_addition(old_text, new_text, entry)
    return new_text
