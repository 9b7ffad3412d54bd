"""Adding a path to ``[tool.graphslot] specs`` in a pyproject.toml, edited as text so its layout and comments stay,
and accepted only when the result parses to the old document plus that path (else :class:`CannotEdit`). Every scan
is linear: tomlkit keeps layouts too, but is quadratic in dotted keys sharing a prefix (python-poetry/tomlkit#479).
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

from ..spec.project import TABLE, validate_table
from ..spec.pyproject_text import line_key, lines_with_offsets, table_header, tomllib

_BLANK = re.compile(r"(?:[ \t\r\n]|#[^\n]*)*")  # whitespace and comments
# A TOML string: multi-line basic and literal ones (which may end in up to two quotes of their own), then the single-
# line ones. The alternatives of each repeated part exclude each other, so a match (or a miss) takes linear time.
_STRING = re.compile(
    r'"""(?:[^"\\]|\\[\s\S]|"(?!""))*"""(?:""?)?'  # multi-line basic
    r"|'''(?:[^']|'(?!''))*'''(?:''?)?"  # multi-line literal
    r'|"(?!"")(?:[^"\\\n]|\\[\s\S])*"'  # basic
    r"|'(?!'')[^'\n]*'"  # literal
)


class CannotEdit(Exception):
    """pyproject.toml cannot be edited safely; ``str()`` says why (one line)."""


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string (control characters were refused before)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def scan_array(text: str, i: int) -> Tuple[int, List[Tuple[int, int]], Optional[int]]:
    """The array of strings starting at ``text[i]`` (``[``): the offset of its ``]``, the (start, end) of each
    string, and the offset of a comma after the last one."""
    elements: List[Tuple[int, int]] = []
    comma = None
    i += 1
    while True:
        i = _BLANK.match(text, i).end()
        if i >= len(text):
            raise CannotEdit("its specs array does not end")
        if text[i] == "]":
            return i, elements, comma
        if text[i] == "," and elements and comma is None:
            comma = i
            i = i + 1
        elif text[i] in "\"'" and (not elements or comma is not None):
            string = _STRING.match(text, i)
            if string is None:
                raise CannotEdit("a string in its specs array does not end")
            elements.append((i, string.end()))
            comma = None
            i = string.end()
        else:
            raise CannotEdit("its specs array is not a plain list of strings")


def _insert_into_array(text: str, open_: int, item: str, key_indent: str, nl: str) -> str:
    close, elements, comma = scan_array(text, open_)
    close_line = text.rfind("\n", 0, close) + 1
    if close_line > open_ and not text[close_line:close].strip():  # ] on a line of its own: a new line above it
        starts = [text[text.rfind("\n", 0, s) + 1 : s] for s, _ in elements[-1:] + elements[:1]]
        indent = next((before for before in starts if not before.strip()), None)  # only whitespace before
        if indent is None:
            inside = [line for _, line in lines_with_offsets(text[open_:close_line])[1:] if line.strip()]
            indent = _indent(inside[-1]) if inside else key_indent + "    "
        new_line = indent + item + ("," if comma is not None or not elements else "") + nl
        text = text[:close_line] + new_line + text[close_line:]
        if elements and comma is None:
            text = text[: elements[-1][1]] + "," + text[elements[-1][1] :]
        return text
    if not elements:
        if text[open_ + 1 : close].strip():
            raise CannotEdit("its specs array is not a plain list of strings")
        return text[: open_ + 1] + item + text[close:]
    if comma is None:
        return text[: elements[-1][1]] + ", " + item + text[elements[-1][1] :]
    return text[: comma + 1] + " " + item + "," + text[comma + 1 :]


def add_spec_entry(text: str, entry: str) -> str:
    """``text`` with ``entry`` appended to ``[tool.graphslot] specs`` (into the array, on its own line when entries
    have theirs; else a new key or table), not verified; CannotEdit where the layout is not one handled."""
    nl = "\r\n" if "\r\n" in text else "\n"
    item = toml_string(entry)
    lines = lines_with_offsets(text)
    headers = [(n, h) for n, (_, line) in enumerate(lines) if (h := table_header(line)) is not None]
    table = [n for n, h in headers if h == (False, "tool.graphslot")]
    if not table:
        block = f"[tool.graphslot]{nl}specs = [{item}]{nl}"
        outputs = [n for n, h in headers if h == (True, "tool.graphslot.outputs")]
        if outputs:  # before the first output entry and the comment lines right above it
            n = outputs[0]
            while n > 0 and lines[n - 1][1].lstrip().startswith("#"):
                n -= 1
            return text[: lines[n][0]] + block + nl + text[lines[n][0] :]
        if text and not text.endswith("\n"):
            text += nl
        if text.strip() and not text.endswith(nl + nl):
            text += nl
        return text + block
    start = table[0]
    end = next((n for n, _ in headers if n > start), len(lines))
    for offset, line in lines[start + 1 : end]:
        key = line_key(line)
        if key is not None and key[0] == "specs":
            if not text.startswith("[", offset + key[1]):
                raise CannotEdit("its specs value is not written as an array [...]")
            return _insert_into_array(text, offset + key[1], item, _indent(line), nl)
    if start + 1 >= len(lines):  # the header is the last line and has no newline
        return text + nl + f"specs = [{item}]{nl}"
    offset = lines[start + 1][0]
    return text[:offset] + f"specs = [{item}]{nl}" + text[offset:]


def verify_addition(old_text: str, new_text: str, entry: str) -> None:
    """CannotEdit unless ``new_text`` parses to ``old_text``'s document with ``entry`` appended to
    ``[tool.graphslot] specs`` (created if need be) and nothing else."""
    unsafe = "its layout is not one graphslot can edit safely (the edit would {})"
    # Floats as their text: a nan anywhere must not make two equal documents differ.
    try:
        new = tomllib.loads(new_text, parse_float=str)
    except tomllib.TOMLDecodeError:
        raise CannotEdit(unsafe.format("not be valid TOML")) from None
    expected = tomllib.loads(old_text, parse_float=str)
    tool = expected.setdefault("tool", {})
    table = tool.setdefault("graphslot", {}) if isinstance(tool, dict) else None
    if not isinstance(table, dict):
        raise CannotEdit(f"its {TABLE} is not a table")
    specs = table.get("specs", [])
    table["specs"] = (list(specs) if isinstance(specs, list) else [specs]) + [entry]
    if new != expected:
        raise CannotEdit(unsafe.format("change more than the specs list"))
    validate_table(new["tool"]["graphslot"], new_text)


def pyproject_with_entry(old_text: str, entry: str) -> str:
    """The edited, verified text (CannotEdit otherwise)."""
    new_text = add_spec_entry(old_text, entry)
    verify_addition(old_text, new_text, entry)
    return new_text
