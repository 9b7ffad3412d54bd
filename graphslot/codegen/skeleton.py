"""The structure check of a generated module, run before it is compiled or written.

Spec files are untrusted, so :func:`check_module_structure` compares the rendered text
with the expected skeleton and refuses anything else (an injection that still parses
included) with a :class:`GeneratedCodeError`. The top level must be, in order:

1. the module docstring (fixed text);
2. ``from graphslot.codegen import runtime as __gs_rt``;
3. the handshake ``__gs_rt.require(__name__, version=<literal>, format=MODULE_FORMAT)``;
4. ``torch = __gs_rt.torch``, then one or more ``<alias> = __gs_rt.<helper>`` of known
   helpers under their mangled names (no import follows a statement: ruff's E402 has
   nothing to say, and no helper is reached before the handshake);
5. the constants SPEC_NAME … SPEC_JSON, each a literal (with ``expected``, that value);
6. ``def allocate`` and ``def bind``, in which nothing imports, declares globals,
   defines classes, or reaches for ``eval``-like names or any dunder.

No library does this: linters (ruff, bandit) flag risky patterns, none says a module is
exactly an expected skeleton with only literals where spec text may land.
"""

from __future__ import annotations

import ast
import copy
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..spec.errors import SpecError, SpecIssue
from ..spec.model import RegistrySpec
from .handshake import MODULE_FORMAT
from .names import RUNTIME_HELPERS

DOCSTRING = "Specialised fill_from / extract for one slot spec: see SPEC_NAME and the banner."

# The top level of every generated module, in order (after the docstring and imports).
CONSTANTS = (
    "SPEC_NAME",
    "SPEC_IDENTITY",
    "GRAPHSLOT_VERSION",
    "PARAMS",
    "RUNTIME_PARAMS",
    "SLOTS",
    "SPEC_SOURCE",
    "SPEC_JSON",
)
FUNCTIONS = ("allocate", "bind")
RUNTIME_PACKAGE, RUNTIME_NAME, RUNTIME_ALIAS = "graphslot.codegen", "runtime", "__gs_rt"
HELPER_ALIASES = dict(RUNTIME_HELPERS)

# Inside the functions generated code never imports, declares globals, defines classes
# or reaches for these names or any dunder attribute; so even a piece of spec text that
# slipped into an expression can do nothing but arithmetic and tensor calls.
_FORBIDDEN_NAMES = frozenset(
    {
        "__import__",
        "__builtins__",
        "__loader__",
        "__spec__",
        "eval",
        "exec",
        "compile",
        "open",
        "globals",
        "locals",
        "vars",
        "breakpoint",
        "input",
        "help",
        "exit",
        "quit",
        "delattr",
        "memoryview",
        "classmethod",
        "staticmethod",
        "property",
        "super",
        "type",
        "object",
    }
)
_FORBIDDEN_NODES = (
    ast.Import,
    ast.ImportFrom,
    ast.Global,
    ast.Nonlocal,
    ast.ClassDef,
    ast.AsyncFunctionDef,
    ast.Await,
    ast.Yield,
    ast.YieldFrom,
    ast.With,
    ast.AsyncWith,
    ast.AsyncFor,
    ast.Delete,
)
# The values a constant may hold that have no Python literal: non-finite floats.
_NON_FINITE = ("inf", "-inf", "nan", "-nan")


class GeneratedCodeError(SpecError):
    """The generated source is not the expected skeleton: spec text would have become
    code (or a generator bug). Nothing is compiled or written."""


def refuse(spec: RegistrySpec, message: str) -> GeneratedCodeError:
    return GeneratedCodeError(
        [SpecIssue(spec.path, None, f"refusing to generate code for spec {ascii(str(spec.name))}: {message}")]
    )


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, ast.Module) else ""
    return f"line {getattr(node, 'lineno', '?')}: {ascii(text[:80])}"


class _NonFinite(ast.NodeTransformer):
    """``float('inf')``, ``float('-inf')``, ``float('nan')``, ``float('-nan')`` -> the constant, so
    :func:`ast.literal_eval` reads them; any other call stays and is refused."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "float"
            and not node.keywords
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in _NON_FINITE
        ):
            return ast.Constant(float(node.args[0].value))
        return node


def literal(node: ast.AST) -> Any:
    """The value of a literal, non-finite floats (``float("inf")``) included;
    ValueError for anything else."""
    return ast.literal_eval(_NonFinite().visit(copy.deepcopy(node)))


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types, containers element by element; floats by their
    repr and sign, so nan matches nan of its sign and -0.0 only -0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return repr(a) == repr(b) and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def _is_handshake(node: ast.stmt, version: Optional[str]) -> bool:
    """``__gs_rt.require(__name__, version=<literal>, format=MODULE_FORMAT)``; with
    ``version``, that very version."""
    call = node.value if isinstance(node, ast.Expr) else None
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "require"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == RUNTIME_ALIAS
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id == "__name__"
        and [k.arg for k in call.keywords] == ["version", "format"]
        and all(isinstance(k.value, ast.Constant) for k in call.keywords)
    ):
        return False
    got_version, got_format = (k.value.value for k in call.keywords)
    return (
        isinstance(got_version, str)
        and (version is None or got_version == version)
        and type(got_format) is int
        and got_format == MODULE_FORMAT
    )


def _bound_from_runtime(node: ast.stmt) -> Optional[Tuple[str, str]]:
    """(name, attribute) of ``name = __gs_rt.attribute``, else None."""
    if (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Attribute)
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == RUNTIME_ALIAS
    ):
        return node.targets[0].id, node.value.attr
    return None


class _Reader:
    """Takes the module's top-level statements one by one, noting the first misfit."""

    def __init__(self, body: List[ast.stmt]):
        self.body, self.problems = list(body), []

    def take(self, kind: str, test: Callable[[ast.stmt], bool]) -> Optional[ast.stmt]:
        if self.problems:
            return None
        node = self.body.pop(0) if self.body else None
        if node is None or not test(node):
            found = _describe(node) if node is not None else "the end of the module"
            self.problems.append(f"expected {kind}, found {found}")
            return None
        return node

    def take_helpers(self) -> None:
        """One or more known helpers, each bound once, up to the first constant."""
        seen = set()
        kind = f"`<helper> = {RUNTIME_ALIAS}.<helper>` of a known helper"

        def helper(n: ast.stmt) -> bool:
            bound = _bound_from_runtime(n)
            if bound is None or HELPER_ALIASES.get(bound[1]) != bound[0] or bound in seen:
                return False
            seen.add(bound)
            return True

        self.take(kind, helper)
        while self.body and not self.problems and _bound_from_runtime(self.body[0]) is not None:
            self.take(kind, helper)


def _constant_test(
    spec: RegistrySpec, expected: Optional[Sequence[Tuple[str, Any]]], position: int, name: str
) -> Callable[[ast.stmt], bool]:
    def constant(n: ast.stmt) -> bool:
        if not (
            isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id == name
        ):
            return False
        try:
            value = literal(n.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        if expected is None:  # the spec's own identity, at least
            known = {"SPEC_NAME": spec.name, "SPEC_IDENTITY": spec.identity, "SPEC_JSON": spec.canonical_json()}
            return name not in known or value == known[name]
        return expected[position][0] == name and _same(expected[position][1], value)

    return constant


def check_module_structure(text: str, spec: RegistrySpec, expected: Optional[Sequence[Tuple[str, Any]]] = None) -> None:
    """Refuse ``text`` unless its top level is exactly the generated skeleton.

    ``expected``: (name, value) of every constant, in order; without it SPEC_NAME and
    SPEC_IDENTITY are checked against ``spec`` and the others only for being literals.
    Raises :class:`GeneratedCodeError` naming the first statement that does not fit.
    """
    if not text.replace("\n", "").isprintable():  # one pass in C; the loop only to name the character
        bad = next(c for c in text if c != "\n" and not c.isprintable())
        raise refuse(spec, f"the source would contain the control character {ascii(bad)}")
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:  # spec text broke the syntax (or a generator bug): never write it
        raise refuse(
            spec,
            f"the generated source does not parse (line {exc.lineno}: {exc.msg}); spec text would have become code",
        ) from None
    reader = _Reader(tree.body)
    reader.take(
        "the module docstring",
        lambda n: isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and n.value.value == DOCSTRING,
    )
    reader.take(
        f"`from {RUNTIME_PACKAGE} import {RUNTIME_NAME} as {RUNTIME_ALIAS}`",
        lambda n: (
            isinstance(n, ast.ImportFrom)
            and n.module == RUNTIME_PACKAGE
            and n.level == 0
            and [(a.name, a.asname) for a in n.names] == [(RUNTIME_NAME, RUNTIME_ALIAS)]
        ),
    )
    version = dict(expected or {}).get("GRAPHSLOT_VERSION")
    reader.take(
        f"the handshake `{RUNTIME_ALIAS}.require(__name__, version=..., format={MODULE_FORMAT})`",
        lambda n: _is_handshake(n, version),
    )
    reader.take(f"`torch = {RUNTIME_ALIAS}.torch`", lambda n: _bound_from_runtime(n) == ("torch", "torch"))
    if not reader.problems:
        reader.take_helpers()
    for position, name in enumerate(CONSTANTS):
        reader.take(f"the constant {name} = <its literal value>", _constant_test(spec, expected, position, name))
    for name in FUNCTIONS:
        node = reader.take(
            f"`def {name}(...)`",
            lambda n, name=name: (
                isinstance(n, ast.FunctionDef) and n.name == name and not n.decorator_list and n.returns is None
            ),
        )
        if node is not None:
            reader.problems += _function_problems(node)
    if not reader.problems and reader.body:
        reader.problems.append(f"unexpected statement after `def bind`, {_describe(reader.body[0])}")
    if reader.problems:
        raise refuse(
            spec,
            f"the generated module is not the expected skeleton ({reader.problems[0]}); spec "
            "text would have become code",
        )


def _function_problems(function: ast.FunctionDef) -> List[str]:
    problems = []
    for node in ast.walk(function):
        if isinstance(node, _FORBIDDEN_NODES):
            problems.append(f"`{type(node).__name__}` in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.Name) and (
            node.id in _FORBIDDEN_NAMES or (node.id.startswith("__") and node.id.endswith("__"))
        ):
            problems.append(f"the name {node.id!r} in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__") and node.attr.endswith("__"):
            problems.append(f"the attribute {node.attr!r} in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.arguments):
            defaults = node.defaults + [d for d in node.kw_defaults if d is not None]
            if any(not isinstance(d, ast.Constant) for d in defaults) or any(
                a.annotation is not None for a in node.args + node.posonlyargs + node.kwonlyargs
            ):
                problems.append(f"a non-literal default or an annotation in `def {function.name}`")
        elif isinstance(node, ast.FunctionDef) and node.decorator_list:
            problems.append(f"a decorator in `def {function.name}`, {_describe(node)}")
    return problems
