"""Lay generated statements out plainly: one line when they fit in :data:`LINE_WIDTH`, else the (last)
brackets' items on one line, else one item a line with a trailing comma; a long condition goes between
parentheses, one operand a line, the operator leading. A ``magic`` collection (one item per slot, param or
plan field) is one item a line even when it fits, so adding an item adds a line and rewrites none.
Generated modules say ``# fmt: off``: this layout only has to read well and diff well. String literals come
from :func:`py_str`, so spec text reaches code only as an escaped literal.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections import namedtuple
from typing import List, Sequence, Tuple, Union

LINE_WIDTH = 88
STEP = 4

# A call (``head`` the callee), a subscript (``[]`` after a head: one index) or a display (``head`` empty);
# ``magic``: one item per line even when it fits.
Seq = namedtuple("Seq", "head items brackets magic", defaults=("()", False))
Keyed = namedtuple("Keyed", "key value")  # a dict entry, ``key: value``
Chained = namedtuple("Chained", "first then")  # ``then`` (a ``.method(...)`` call) on the result of ``first``
Chain = namedtuple("Chain", "op operands")  # operands joined by ``and`` / ``or``; a Chain operand in parentheses
Item = Union[str, Seq, Keyed, Chained]
Operand = Union[str, Chain]


def call(func: str, *args: Item) -> Seq:
    return Seq(func, tuple(args))


def method(receiver: Item, name: str, *args: Item) -> Item:
    """``receiver.name(args)``: a chain when ``receiver`` is itself a call or subscript."""
    if isinstance(receiver, Seq):
        return Chained(receiver, call(f".{name}", *args))
    return call(f"{flat(receiver)}.{name}", *args)


def subscript(name: str, index: str) -> Seq:
    return Seq(name, (index,), "[]")


def list_of(items: Sequence[Item]) -> Seq:
    return Seq("", tuple(items), "[]", bool(items))


def tuple_of(items: Sequence[Item]) -> Seq:
    """A one-item tuple stays on its line (``(x,)``)."""
    return Seq("", tuple(items), "()", len(items) > 1)


def dict_of(entries: Sequence[Tuple[str, Item]]) -> Seq:
    return Seq("", tuple(Keyed(f"{k}: ", v) for k, v in entries), "{}", bool(entries))


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
    if not item.head and item.brackets == "()" and len(item.items) == 1:  # a one-item tuple
        inner += ","
    return f"{item.head}{item.brackets[0]}{inner}{item.brackets[1]}"


def _magic(item: Item) -> bool:
    if isinstance(item, Keyed):
        return _magic(item.value)
    if isinstance(item, Chained):
        return _magic(item.first) or _magic(item.then)
    return isinstance(item, Seq) and (item.magic or any(_magic(i) for i in item.items))


def _fits(indent: int, text: str) -> bool:
    return indent + len(text) <= LINE_WIDTH


def layout(item: Item, indent: int, lead: str = "", tail: str = "") -> List[str]:
    """The lines of ``lead`` + ``item`` + ``tail`` at ``indent`` spaces."""
    pad = " " * indent
    if isinstance(item, str) or (not _magic(item) and _fits(indent, lead + flat(item) + tail)):
        return [pad + lead + flat(item) + tail]
    if isinstance(item, Keyed):
        return layout(item.value, indent, lead + item.key, tail)
    if isinstance(item, Chained):  # split the last call while the line up to it fits
        if _fits(indent, lead + flat(item.first) + item.then.head + "(") or _magic(item.then):
            return layout(item.then, indent, lead + flat(item.first), tail)
        return layout(item.first, indent, lead, flat(item.then) + tail)
    lines = [pad + lead + item.head + item.brackets[0]]
    if not _magic(item) and _fits(indent + STEP, ", ".join(flat(i) for i in item.items)):
        return lines + [" " * (indent + STEP) + ", ".join(flat(i) for i in item.items), pad + item.brackets[1] + tail]
    comma = "" if item.head and item.brackets == "[]" else ","  # a subscript's one index: no comma may be added
    for i in item.items:
        lines += layout(i, indent + STEP, "", comma)
    return lines + [pad + item.brackets[1] + tail]


def assign(target: str, value: Item, indent: int, op: str = "=") -> List[str]:
    """``target = value`` (or ``+=``); a first line too long goes between parentheses."""
    lines = layout(value, indent, f"{target} {op} ")
    pad = " " * indent
    if len(lines[0]) <= LINE_WIDTH:
        return lines
    return [f"{pad}{target} {op} ("] + layout(value, indent + STEP) + [pad + ")"]


def concatenated(target: str, groups: Sequence[str]) -> List[str]:
    """Top-level ``target = "".join(groups)``: one literal, else concatenated ones, each group starting a line."""
    whole = f"{target} = {py_str(''.join(groups))}"
    if _fits(0, whole):
        return [whole]
    lines = [f"{target} = ("]
    for text in groups:
        while text:
            n = min(len(text), LINE_WIDTH - STEP - 2)
            while n > 1 and not _fits(STEP, py_str(text[:n])):
                n -= 1
            if n < len(text) and text.rfind(",", 1, n) > n // 2:  # cut before a comma when one is near
                n = text.rfind(",", 1, n)
            lines.append(" " * STEP + py_str(text[:n]))
            text = text[n:]
    return lines + [")"]


def _operands(chain: Operand, indent: int, lead: str = "") -> List[str]:
    pad = " " * indent
    if isinstance(chain, str) or _fits(indent, f"{lead}({flat(chain)})"):
        return [pad + lead + (chain if isinstance(chain, str) else f"({flat(chain)})")]
    lines = [f"{pad}{lead}("]
    for i, operand in enumerate(chain.operands):
        lines += _operands(operand, indent + STEP, "" if i == 0 else f"{chain.op} ")
    return lines + [pad + ")"]


def condition(keyword: str, chain: Operand, indent: int) -> List[str]:
    """``keyword chain:`` (an ``if``)."""
    while isinstance(chain, Chain) and len(chain.operands) == 1:
        chain = chain.operands[0]
    pad = " " * indent
    if isinstance(chain, str) or _fits(indent, f"{keyword} {flat(chain)}:"):
        return [f"{pad}{keyword} {flat(chain)}:"]
    lines = _operands(chain, indent, f"{keyword} ")
    return lines[:-1] + [lines[-1] + ":"]


def py_str(text: str) -> str:
    """``text`` as a one-line literal: double quotes unless it holds more of them, escaped as ``repr()`` does."""
    quote = "'" if text.count('"') > text.count("'") else '"'
    if text.isascii() and text.isprintable() and "\\" not in text and quote not in text:
        return quote + text + quote  # nothing to escape (the common case; SPEC_JSON is long)
    body = "".join("\\" + c if c == quote else c if c in "'\"" else repr(c)[1:-1] for c in text)
    return quote + body + quote


def normalise(source: str) -> str:
    """A one-line expression (``Expr.to_python``, a ``repr``) with its string literals written by :func:`py_str`."""
    out = []
    pos = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING:
            (row, start), (_, end) = token.start, token.end
            if row != 1:  # columns are offsets only on one line: never splice a multi-line source
                raise ValueError(f"not a one-line expression: {source!r}")
            out += [source[pos:start], py_str(ast.literal_eval(token.string))]
            pos = end
    return "".join(out) + source[pos:]
