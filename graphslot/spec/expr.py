"""Small expressions in slot specs (shapes, pad values, ``enabled_if``, param defaults),
parsed with :func:`ast.parse` and walked by :class:`Expr`: never given to ``eval``, so a spec
computes numbers, it cannot run code. Anything outside the language fails on load."""

from __future__ import annotations

import ast
import functools
import math
import operator
from typing import Any, Collection, Dict, Mapping, Optional

from graphslot.spec.dtypes import DTypeName, is_torch_dtype
from graphslot.spec.errors import ExprError, did_you_mean, shorten

TYPES = ("int", "float", "bool", "str", "dtype")
_NUMERIC = ("int", "float")

# What the language has, for error messages and docs ("expressions may use ...").
ALLOWED = "names, int/float/bool literals, + - * // %, comparisons, and/or/not, 'a if c else b', max(), min()"

# Bounds on untrusted text: the longest expression, its deepest nesting (a sum of n
# terms nests n deep), and integers met while evaluating: |value| < INT_LIMIT, the
# signed 64-bit range every buffer dtype and index lives in.
MAX_EXPR_LENGTH = 1000
MAX_EXPR_DEPTH = 50
INT_LIMIT = 2**63

# YAML people write true/false; they read as the bools, never as params.
_BOOL_NAMES = {"true": True, "false": False}
_FUNCS = {"max": max, "min": min}


def _table(rows: str) -> Dict[type, tuple]:
    """``"Add + add, ..."`` → ``{ast.Add: ("+", operator.add), ...}``: ast node, symbol, operator."""
    return {getattr(ast, node): (sym, getattr(operator, fn)) for node, sym, fn in map(str.split, rows.split(","))}


_UNARY = _table("USub - neg, UAdd + pos, Not not not_")
_BINOPS = _table("Add + add, Sub - sub, Mult * mul, FloorDiv // floordiv, Mod % mod")
_COMPARE = _table("Eq == eq, NotEq != ne, Lt < lt, LtE <= le, Gt > gt, GtE >= ge")

# Python's precedence levels, lowest first: to_python adds only the parentheses needed.
_P_IF, _P_OR, _P_AND, _P_NOT, _P_CMP, _P_ADD, _P_MUL, _P_UNARY, _P_ATOM = range(9)
_NOT_CONSTANT = object()


class _ZeroDivision(ExprError):
    """Kept apart so to_python can leave an unreachable ``x // 0`` to the generated code."""


def python_type_name(value: Any) -> Optional[str]:
    """The name in :data:`TYPES` of a param value, or None when it is none of them."""
    if isinstance(value, DTypeName) or is_torch_dtype(value):  # before str: a DTypeName is one
        return "dtype"
    for kind in (bool, int, float, str):  # bool before int: bool is a subclass of int
        if isinstance(value, kind):
            return kind.__name__
    return None


def _free_names(node: ast.AST) -> frozenset[str]:
    if isinstance(node, ast.Name):
        return frozenset() if node.id in _BOOL_NAMES else frozenset({node.id})
    children = node.args if isinstance(node, ast.Call) else ast.iter_child_nodes(node)
    return frozenset().union(*(_free_names(c) for c in children))


def python_literal(value: Any) -> str:
    """Python source for a spec value: ``repr``, a non-finite float as ``float('-inf')`` and the
    like (a NaN's sign kept: YAML's ``.nan`` has it set and a buffer stores it)."""
    if isinstance(value, float) and not math.isfinite(value):
        sign = "-" if math.copysign(1.0, value) < 0 else ""
        return f"float('{sign}{abs(value)}')"
    return repr(value)


def _literal(value: Any) -> tuple[str, int]:
    # torch.int64 -> 'torch.int64'; a dtype name is written the same way
    src = f"torch.{value}" if isinstance(value, DTypeName) else python_literal(value)
    return src, _P_UNARY if src.startswith("-") else _P_ATOM


class Expr:
    """A parsed expression; equal and hashed by its text."""

    __slots__ = ("text", "names", "_source", "_tree", "_shown")

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ExprError(f"expression must be a string, got {type(text).__name__} {shorten(text)}")
        self.text = text
        self._shown = shorten(text, quote=False)  # how messages quote it
        self._source = text.strip()  # YAML may leave spaces around it; ast rejects a leading one
        if len(self._source) > MAX_EXPR_LENGTH:
            raise ExprError(
                f"expression '{self._shown}' is {len(self._source)} characters long; "
                f"at most {MAX_EXPR_LENGTH} are allowed"
            )
        try:
            self._tree = ast.parse(self._source, mode="eval").body
        except (SyntaxError, ValueError) as e:  # ValueError: e.g. a NUL byte
            msg = shorten(str(getattr(e, "msg", e)), 200, quote=False)
            raise ExprError(f"invalid expression '{self._shown}': {msg}") from None
        except (RecursionError, MemoryError):
            raise self._too_deep() from None
        self._check_syntax(self._tree, 1)
        self.names: frozenset[str] = _free_names(self._tree)

    @staticmethod
    def parse(text: str) -> "Expr":
        """The parsed expression, kept per text (an Expr never changes): nothing is parsed twice."""
        return _parse(text) if isinstance(text, str) else Expr(text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expr) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"

    def infer_type(self, types: Mapping[str, str]) -> str:
        """The type in :data:`TYPES` of the value, given the type of every name."""
        return self._walk(self._tree, types, static=True)

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return self._walk(self._tree, env, static=False)

    def to_python(self, env: Mapping[str, Any], keep: Collection[str] = ()) -> str:
        """Python source: names in ``keep`` stay names (a mapping renames them), the others
        take their value in ``env``, and what is then constant is folded."""
        keep = dict(keep) if isinstance(keep, Mapping) else {name: name for name in keep}
        if not self.names & keep.keys():
            return _literal(self.evaluate(env))[0]
        return self._emit(self._tree, env, keep)[0]

    # -- errors -----------------------------------------------------------------

    def _fragment(self, node: ast.AST) -> str:
        return shorten(ast.get_source_segment(self._source, node) or ast.unparse(node), quote=False)

    def _fail(self, node: ast.AST, reason: str, prefix: str = "") -> ExprError:
        return ExprError(f"{prefix}'{self._fragment(node)}' in expression '{self._shown}': {reason}")

    def _too_deep(self) -> ExprError:
        return ExprError(
            f"expression '{self._shown}' nests deeper than {MAX_EXPR_DEPTH} levels (a sum of n terms nests n deep)"
        )

    def _bounded(self, node: ast.AST, value: Any) -> Any:
        """``value``, unless it is an int outside the signed 64-bit range."""
        if type(value) is int and not -INT_LIMIT < value < INT_LIMIT:
            raise self._fail(
                node,
                f"integer overflow: the value has {value.bit_length()} bits, "
                "beyond the signed 64-bit range (|value| < 2**63)",
            )
        return value

    # -- syntax -----------------------------------------------------------------

    def _check_syntax(self, node: ast.AST, depth: int) -> None:
        if depth > MAX_EXPR_DEPTH:  # before the walks below recurse
            raise self._too_deep()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
            if node.keywords or len(node.args) < 2 or any(isinstance(a, ast.Starred) for a in node.args):
                raise self._fail(
                    node, f"{node.func.id}() takes two or more positional arguments", "unsupported syntax "
                )
            children = node.args
        elif (
            isinstance(node, (ast.Name, ast.BoolOp, ast.IfExp))
            or (isinstance(node, ast.Constant) and type(node.value) in (int, float, bool, str))
            or (isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY)
            or (isinstance(node, ast.BinOp) and type(node.op) in _BINOPS)
            or (isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops))
        ):
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        else:
            raise self._fail(node, f"expressions may use {ALLOWED}", "unsupported syntax ")
        for child in children:
            self._check_syntax(child, depth + 1)

    # -- the walk ---------------------------------------------------------------

    def _walk(self, node: ast.AST, env: Mapping[str, Any], static: bool) -> Any:
        """The value of ``node`` given the names' values, or (``static``) its type given theirs:
        one walk, so that infer_type and evaluate apply the same type rules."""
        kind = (lambda t: t) if static else python_type_name  # the type of what a walk returns

        def walk(child: ast.AST) -> Any:
            return self._walk(child, env, static)

        match node:
            case ast.Constant(value=value):
                return python_type_name(value) if static else self._bounded(node, value)
            case ast.Name(id=name) if name in _BOOL_NAMES:
                return "bool" if static else _BOOL_NAMES[name]
            case ast.Name(id=name):
                if name not in env:
                    raise ExprError(
                        f"unknown name '{shorten(name, quote=False)}' in expression '{self._shown}'"
                        + did_you_mean(name, env.keys())
                    )
                value = env[name]
                if not static and kind(value) is None:
                    got = type(value).__name__
                    allowed = ", ".join(TYPES)
                    raise self._fail(node, f"value {shorten(value)} has type {got}, not one of {allowed}")
                return value if static else self._bounded(node, value)
            case ast.UnaryOp(op=op, operand=x):
                sym, fn = _UNARY[type(op)]
                a = walk(x)
                if kind(a) not in (("bool",) if sym == "not" else _NUMERIC):
                    what = "'not'" if sym == "not" else f"unary '{sym}'"
                    raise self._fail(node, f"cannot apply {what} to {kind(a)}")
                return a if static else self._bounded(node, fn(a))
            case ast.BinOp(left=left, op=op, right=right):
                sym, fn = _BINOPS[type(op)]
                a = walk(left)
                b = walk(right)
                if kind(a) not in _NUMERIC or kind(b) not in _NUMERIC:
                    raise self._fail(node, f"cannot apply '{sym}' to {kind(a)} and {kind(b)}")
                if static:
                    return "float" if "float" in (a, b) else "int"
                try:
                    return self._bounded(node, fn(a, b))
                except ZeroDivisionError:
                    raise _ZeroDivision(f"division by zero in expression '{self._shown}'") from None
                except OverflowError as e:
                    raise self._fail(node, str(e)) from None
            case ast.Compare(left=left, ops=ops, comparators=rest):
                a = walk(left)
                for op, right in zip(ops, rest):  # like Python: stop at the first false link
                    sym, fn = _COMPARE[type(op)]
                    b = walk(right)
                    numeric = kind(a) in _NUMERIC and kind(b) in _NUMERIC
                    if not (numeric or (sym in ("==", "!=") and kind(a) == kind(b))):
                        raise self._fail(node, f"cannot compare {kind(a)} and {kind(b)} with '{sym}'")
                    if not static and not fn(a, b):
                        return False
                    a = b
                return "bool" if static else True
            case ast.BoolOp(op=op, values=values):
                decides = isinstance(op, ast.Or)  # the operand value that ends the chain
                for value in values:
                    result = walk(value)
                    self._need_bool(node, kind(result))
                    if not static and result == decides:
                        return result
                return "bool" if static else result
            case ast.IfExp(test=test, body=body, orelse=orelse):
                cond = walk(test)
                self._need_bool(node, kind(cond))
                if not static:
                    return walk(body if cond else orelse)
                a = walk(body)
                b = walk(orelse)
                if a != b and not (a in _NUMERIC and b in _NUMERIC):
                    raise self._fail(node, f"branches have different types {a} and {b}")
                return a if a == b else "float"
            case ast.Call(func=ast.Name(id=fn), args=args):
                values = [walk(a) for a in args]
                kinds = [kind(v) for v in values]
                bad = [k for k in kinds if k not in _NUMERIC]
                if bad:
                    raise self._fail(node, f"{fn}() needs int or float arguments, got {bad[0]}")
                return ("float" if "float" in kinds else "int") if static else _FUNCS[fn](*values)

    def _need_bool(self, node: ast.BoolOp | ast.IfExp, kind: str) -> None:
        """An operand of and/or, or the condition of an if, is a bool."""
        if isinstance(node, ast.IfExp) and kind != "bool":
            raise self._fail(node, f"condition must be bool, got {kind}")
        if kind != "bool":
            raise self._fail(node, f"cannot apply '{'or' if isinstance(node.op, ast.Or) else 'and'}' to {kind}")

    def _fold(self, node: ast.AST, env: Mapping[str, Any], keep: Mapping[str, str]) -> Any:
        """The value of a sub-expression without kept names, else _NOT_CONSTANT."""
        if _free_names(node) & keep.keys():
            return _NOT_CONSTANT
        try:
            return self._walk(node, env, static=False)
        except _ZeroDivision:
            # It may sit in a branch that is never taken; the generated code then
            # fails exactly when evaluate would.
            return _NOT_CONSTANT

    def _emit(self, node: ast.AST, env: Mapping[str, Any], keep: Mapping[str, str]) -> tuple[str, int]:
        """(source, precedence) of a sub-expression."""
        value = self._fold(node, env, keep)
        if value is not _NOT_CONSTANT:
            return _literal(value)

        def sub(child: ast.AST, min_prec: int) -> str:
            src, prec = self._emit(child, env, keep)
            return f"({src})" if prec < min_prec else src

        match node:
            case ast.Name(id=name):  # only a kept name gets here
                return keep[name], _P_ATOM
            case ast.UnaryOp(op=ast.Not(), operand=x):
                return f"not {sub(x, _P_NOT)}", _P_NOT
            case ast.UnaryOp(op=op, operand=x):
                return f"{_UNARY[type(op)][0]}{sub(x, _P_UNARY)}", _P_UNARY
            case ast.BinOp(left=left, op=op, right=right):
                prec = _P_ADD if isinstance(op, (ast.Add, ast.Sub)) else _P_MUL
                return f"{sub(left, prec)} {_BINOPS[type(op)][0]} {sub(right, prec + 1)}", prec
            case ast.Compare(left=left, ops=ops, comparators=rest):
                parts = [sub(left, _P_CMP + 1)]
                for op, right in zip(ops, rest):
                    parts += [_COMPARE[type(op)][0], sub(right, _P_CMP + 1)]
                return " ".join(parts), _P_CMP
            case ast.BoolOp(op=op, values=values):
                word, prec = ("or", _P_OR) if isinstance(op, ast.Or) else ("and", _P_AND)
                parts: list[tuple[str, int]] = []
                for child in values:
                    value = self._fold(child, env, keep)
                    if value is _NOT_CONSTANT:
                        parts.append(self._emit(child, env, keep))
                        continue
                    self._need_bool(node, python_type_name(value))
                    if value == (word == "or"):  # decides the result once reached
                        parts.append(_literal(value))
                        break
                    # Any other constant drops out: for a bool x, `x and True` is x.
                if len(parts) == 1:
                    return parts[0]
                return f" {word} ".join(f"({s})" if p <= prec else s for s, p in parts), prec
            case ast.IfExp(test=test, body=body, orelse=orelse):
                cond = self._fold(test, env, keep)
                if cond is not _NOT_CONSTANT:
                    self._need_bool(node, python_type_name(cond))
                    return self._emit(body if cond else orelse, env, keep)
                # `a if b else c if d else e` needs no parentheses; a nested one in front does.
                src = f"{sub(body, _P_IF + 1)} if {sub(test, _P_IF + 1)} else {sub(orelse, _P_IF)}"
                return src, _P_IF
            case ast.Call(func=ast.Name(id=fn), args=args):
                return f"{fn}({', '.join(sub(a, _P_IF) for a in args)})", _P_ATOM


_parse = functools.lru_cache(maxsize=4096)(Expr)


def evaluate_field(value: Any, env: Mapping[str, Any]) -> Any:
    """A spec value that is a literal or an expression string."""
    return Expr.parse(value).evaluate(env) if isinstance(value, str) else value
