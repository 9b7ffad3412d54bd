"""Lay generated statements out as ``ruff format`` (default settings) would write them.

Generated modules are committed and reviewed; an engine's formatter hook must leave them
as they are, or ``graphslot generate --check`` and the hook would undo each other
forever. So the builders describe each statement that can grow with the spec as a small
tree (:class:`Seq` for bracketed, comma-separated items, :class:`Chain` for ``and`` /
``or`` conditions) and this module prints it the way ruff does:

* a statement that fits in :data:`LINE_WIDTH` columns stays on one line;
* otherwise a call or a subscript first puts its arguments on one indented line
  between its brackets, then one per line with a trailing comma; a list, tuple or dict
  display goes one item per line with a trailing comma at once;
* a collection marked ``magic`` is one item per line even when it would fit: the
  trailing comma is then "magic" (ruff keeps the layout), so adding an item adds a line
  and rewrites none;
* a condition too long for its line is wrapped in parentheses, one operand per line
  with the operator leading, a parenthesized operand on one line when it fits.

String literals are written in ruff's quote style by :func:`py_str`, a ``repr()`` with
ruff's choice of quotes: spec text still reaches code only as an escaped literal.

This is not a formatter: it prints the few shapes of statement the builders make, in
the shapes ruff gives them while their names fit (slot names up to about 40
characters; sglang's longest has 33). Nothing here knows about slots;
``tests/test_generated_format.py`` checks the result against ruff itself.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

LINE_WIDTH = 88  # ruff's default
STEP = 4

CALL, SUBSCRIPT, DISPLAY = "call", "subscript", "display"


@dataclass(frozen=True)
class Seq:
    """``head`` followed by ``items`` between ``brackets``: a call (``head`` is the
    callee), a subscript (``head`` the subscripted name, one index) or a display (a
    list, tuple or dict literal; ``head`` empty)."""

    head: str
    items: Tuple["Item", ...]
    brackets: str = "()"
    kind: str = CALL
    magic: bool = False  # one item per line even when it fits (a magic trailing comma)


@dataclass(frozen=True)
class Keyed:
    """A dict entry, ``key: value``, whose value may need laying out."""

    key: str
    value: "Item"


@dataclass(frozen=True)
class Chained:
    """``then`` (a ``.method(...)`` call) on the result of ``first``."""

    first: Seq
    then: Seq


@dataclass(frozen=True)
class Chain:
    """Operands joined by ``op`` (``and`` / ``or``); a Chain operand is parenthesized."""

    op: str
    operands: Tuple["Operand", ...]


Item = Union[str, Seq, Keyed, Chained]
Operand = Union[str, Chain]


# --- building -------------------------------------------------------------------------------


def call(func: str, *args: Item) -> Seq:
    return Seq(func, tuple(args))


def method(receiver: Item, name: str, *args: Item) -> Item:
    """``receiver.name(args)``: a chain when ``receiver`` is itself a call or subscript."""
    if isinstance(receiver, Seq):
        return Chained(receiver, call(f".{name}", *args))
    return call(f"{flat(receiver)}.{name}", *args)


def subscript(name: str, index: str) -> Seq:
    return Seq(name, (index,), "[]", SUBSCRIPT)


# The displays the builders make hold one item per slot, param or plan field: one item a
# line (magic), so that adding one adds a line.


def list_of(items: Sequence[Item]) -> Seq:
    return Seq("", tuple(items), "[]", DISPLAY, bool(items))


def tuple_of(items: Sequence[Item]) -> Seq:
    """From two items (ruff collapses a one-item tuple whatever its comma)."""
    return Seq("", tuple(items), "()", DISPLAY, len(items) > 1)


def dict_of(entries: Sequence[Tuple[str, Item]]) -> Seq:
    return Seq("", tuple(Keyed(f"{k}: ", v) for k, v in entries), "{}", DISPLAY, bool(entries))


# --- printing -------------------------------------------------------------------------------


def flat(item: Union[Item, Chain]) -> str:
    """``item`` on one line."""
    if isinstance(item, str):
        return item
    if isinstance(item, Keyed):
        return item.key + flat(item.value)
    if isinstance(item, Chained):
        return flat(item.first) + flat(item.then)
    if isinstance(item, Chain):
        return f" {item.op} ".join(f"({flat(o)})" if isinstance(o, Chain) else o for o in item.operands)
    inner = ", ".join(flat(i) for i in item.items)
    if item.kind == DISPLAY and item.brackets == "()" and len(item.items) == 1:
        inner += ","
    return f"{item.head}{item.brackets[0]}{inner}{item.brackets[1]}"


def _forced(item: Item) -> bool:
    if isinstance(item, Keyed):
        return _forced(item.value)
    if isinstance(item, Chained):
        return _forced(item.first) or _forced(item.then)
    return isinstance(item, Seq) and (item.magic or any(_forced(i) for i in item.items))


def _fits(indent: int, text: str) -> bool:
    return indent + len(text) <= LINE_WIDTH


def layout(item: Item, indent: int, lead: str = "", tail: str = "") -> List[str]:
    """The lines of ``lead`` + ``item`` + ``tail`` at ``indent`` spaces."""
    pad = " " * indent
    text = flat(item)
    if isinstance(item, str) or (not _forced(item) and _fits(indent, lead + text + tail)):
        return [pad + lead + text + tail]
    if isinstance(item, Keyed):
        return layout(item.value, indent, lead + item.key, tail)
    if isinstance(item, Chained):  # the last call's brackets when the line up to them fits
        head = flat(item.first)
        if _fits(indent, lead + head + item.then.head + item.then.brackets[0]):
            return layout(item.then, indent, lead + head, tail)
        return layout(item.first, indent, lead, flat(item.then) + tail)
    first, last, inner = pad + lead + item.head + item.brackets[0], pad + item.brackets[1] + tail, indent + STEP
    if item.kind != DISPLAY and not _forced(item):
        body = ", ".join(flat(i) for i in item.items)
        if _fits(inner, body):
            return [first, " " * inner + body, last]
    if item.kind == SUBSCRIPT:  # one index: no comma may be added
        return [first] + layout(item.items[0], inner) + [last]
    lines = [first]
    for i in item.items:
        lines += layout(i, inner, "", ",")
    return lines + [last]


def assign(target: str, value: Item, indent: int, op: str = "=") -> List[str]:
    """``target = value`` (or ``+=``); a value too long for the line is split at its own
    (last) brackets when the line up to them fits, else put between parentheses."""
    lead = f"{target} {op} "
    if _fits(indent, lead + flat(value)) and not _forced(value):
        return [" " * indent + lead + flat(value)]
    opening = value.first if isinstance(value, Chained) else value
    if isinstance(opening, Seq) and opening.head and _fits(indent, lead + opening.head + opening.brackets[0]):
        return layout(value, indent, lead)
    if isinstance(opening, Seq) and not opening.head:  # a display: its own brackets
        return layout(value, indent, lead)
    pad = " " * indent
    return [f"{pad}{lead}("] + layout(value, indent + STEP) + [pad + ")"]


def unpack(targets: Sequence[str], value: str, indent: int) -> List[str]:
    """``targets = value``: several targets one per line (magic), one as ``(x,)``."""
    if not targets:
        return []
    if len(targets) == 1:
        return [" " * indent + f"({targets[0]},) = {value}"]
    return layout(tuple_of(targets), indent, "", f" = {value}")


def _chunks(text: str, width: int) -> List[str]:
    """``text`` cut into pieces whose literals (:func:`py_str`) fit in ``width`` columns,
    each cut before a comma where one is near enough (any cut gives the same string)."""
    chunks = []
    while text and len(py_str(text)) > width:
        n = min(len(text), width - 2)
        while n > 1 and len(py_str(text[:n])) > width:
            n -= 1
        comma = text.rfind(",", 1, n)  # cut before a comma: a piece's first line starts with its own
        cut = comma if comma > n // 2 else n
        chunks.append(text[:cut])
        text = text[cut:]
    return chunks + ([text] if text else [])


def concatenated(target: str, groups: Sequence[str], indent: int = 0) -> List[str]:
    """``target = <the string of groups joined>``, as ruff lays out implicitly
    concatenated literals: one literal where it fits on the line, or on its own line
    between parentheses; else literals between parentheses, each group starting a line
    and cut to fit the columns (ruff then joins none, and sets each one's quotes)."""
    whole, pad, inner = "".join(groups), " " * indent, indent + STEP
    if _fits(indent, f"{target} = {py_str(whole)}"):
        return [f"{pad}{target} = {py_str(whole)}"]
    if _fits(inner, py_str(whole)):
        return [f"{pad}{target} = (", " " * inner + py_str(whole), pad + ")"]
    parts = [chunk for group in groups for chunk in _chunks(group, LINE_WIDTH - inner)]
    return [f"{pad}{target} = ("] + [" " * inner + py_str(part) for part in parts] + [pad + ")"]


_COMPARISON = re.compile(r" (is not|is|!=|==|<=|>=|<|>) ")


def _operand(lead: str, operand: str, indent: int) -> List[str]:
    """A comparison too long for its line breaks before its operator."""
    pad = " " * indent
    split = _COMPARISON.search(operand)
    if _fits(indent, lead + operand) or split is None:
        return [pad + lead + operand]
    return [pad + lead + operand[: split.start()], pad + operand[split.start() + 1:]]


def _paren_body(chain: Chain, indent: int) -> List[str]:
    """A chain between parentheses: one line when it fits, else an operand per line."""
    pad = " " * indent
    if _fits(indent, flat(chain)):
        return [pad + flat(chain)]
    lines = []
    for i, operand in enumerate(chain.operands):
        lead = "" if i == 0 else f"{chain.op} "
        if not isinstance(operand, Chain):
            lines += _operand(lead, operand, indent)
        elif _fits(indent, f"{lead}({flat(operand)})"):
            lines.append(f"{pad}{lead}({flat(operand)})")
        else:
            lines += [f"{pad}{lead}("] + _paren_body(operand, indent + STEP) + [pad + ")"]
    return lines


def condition(keyword: str, chain: Operand, indent: int) -> List[str]:
    """``keyword chain:`` (an ``if``). Ruff drops parentheses around a whole condition;
    a condition of two operands whose last is parenthesized is split at that
    parenthesis when the line up to it fits (its "optional parentheses" are omitted)."""
    while isinstance(chain, Chain) and len(chain.operands) == 1:
        chain = chain.operands[0]
    pad = " " * indent
    if _fits(indent, f"{keyword} {flat(chain)}:"):
        return [f"{pad}{keyword} {flat(chain)}:"]
    if isinstance(chain, str):
        return [f"{pad}{keyword} ("] + _operand("", chain, indent + STEP) + [pad + "):"]
    first, last = chain.operands[0], chain.operands[-1]
    if len(chain.operands) == 2 and isinstance(last, Chain):
        head = f"{keyword} {f'({flat(first)})' if isinstance(first, Chain) else first} {chain.op} ("
        if _fits(indent, head):
            return [pad + head] + _paren_body(last, indent + STEP) + [pad + "):"]
        if isinstance(first, Chain):
            return ([f"{pad}{keyword} ("] + _paren_body(first, indent + STEP) + [f"{pad}) {chain.op} ("]
                    + _paren_body(last, indent + STEP) + [pad + "):"])
    return [f"{pad}{keyword} ("] + _paren_body(chain, indent + STEP) + [pad + "):"]


# --- literals -------------------------------------------------------------------------------


def py_str(text: str) -> str:
    """``text`` as a string literal in ruff's style: double quotes unless the text holds
    more double quotes than single ones; every other character escaped exactly as
    ``repr()`` escapes it (so one printable line, whatever ``text`` holds)."""
    quote = "'" if text.count('"') > text.count("'") else '"'
    if text.isascii() and text.isprintable() and "\\" not in text and quote not in text:
        return quote + text + quote  # nothing to escape (the common case; SPEC_JSON is long)
    body = "".join("\\" + c if c == quote else c if c in "'\"" else repr(c)[1:-1] for c in text)
    return quote + body + quote


def _number(token: str) -> str:
    """A number (as ``repr`` writes it) as ruff writes it: no ``+`` in an exponent."""
    return token.replace("e+", "e")


def normalise(source: str) -> str:
    """A one-line Python expression (``Expr.to_python``, a ``repr``) with its string
    literals in ruff's quotes and its numbers in ruff's spelling; nothing else changes."""
    out, pos = [], 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.STRING, tokenize.NUMBER):
            continue
        (row, start), (_, end) = token.start, token.end
        if row != 1:
            raise ValueError(f"not a one-line expression: {source!r}")
        value = token.string
        out += [source[pos:start], py_str(ast.literal_eval(value)) if token.type == tokenize.STRING else _number(value)]
        pos = end
    return "".join(out) + source[pos:]

