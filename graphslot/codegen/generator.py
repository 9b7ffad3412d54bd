"""Render the generated module for one (spec, params): source text, checked before use.

Spec files (and the pyproject.toml that declares outputs) are untrusted input, so no
text they hold is ever emitted raw: in the banner it appears only as ``ascii()``
literals (one line, every control or non-ASCII character escaped), the docstring is
fixed text, and in code only as ``repr()`` literals. Then, before the source is
compiled or written, :func:`check_module_structure` compares it with the expected
skeleton — the module docstring, the version handshake with
``graphslot.codegen.runtime``, ``import torch``, one import of known helpers from it,
the known constants with literal values, ``def allocate`` and ``def bind`` — and
refuses anything else (an injection that still parses included) with a
:class:`GeneratedCodeError`.
"""

from __future__ import annotations

import ast
import copy
import math
import re
from functools import lru_cache
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import jinja2

from .._version import __version__
from ..spec.dtypes import DTypeName, dtype_name, is_torch_dtype
from ..spec.errors import SpecError, SpecIssue
from ..spec.expr import python_literal
from ..spec.model import RegistrySpec
from .emitter import PLAN_CACHE_LIMIT, RUNTIME_HELPERS, Emission, Emitter, params_literal
from .handshake import MODULE_FORMAT

REGENERATE = "graphslot generate"
RULE = "-" * 86
DOCSTRING = "Specialised fill_from / extract for one slot spec: SPEC_NAME below, the banner above."

# The top level of every generated module, in order (after the docstring and imports).
CONSTANTS = ("SPEC_NAME", "SPEC_IDENTITY", "GRAPHSLOT_VERSION", "PARAMS", "RUNTIME_PARAMS", "SLOTS")
FUNCTIONS = ("allocate", "bind")
RUNTIME_PACKAGE, RUNTIME_NAME, RUNTIME_ALIAS = "graphslot.codegen", "runtime", "__gs_rt"
RUNTIME_MODULE = f"{RUNTIME_PACKAGE}.{RUNTIME_NAME}"
_HELPER_ALIASES = dict(RUNTIME_HELPERS)

# Inside the functions generated code never imports, declares globals, defines classes
# or reaches for these names or any dunder attribute; so even a piece of spec text that
# slipped into an expression can do nothing but arithmetic and tensor calls.
_FORBIDDEN_NAMES = frozenset({
    "__import__", "__builtins__", "__loader__", "__spec__", "eval", "exec", "compile", "open", "globals",
    "locals", "vars", "breakpoint", "input", "help", "exit", "quit", "delattr", "memoryview", "classmethod",
    "staticmethod", "property", "super", "type", "object",
})
_FORBIDDEN_NODES = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.AsyncFunctionDef,
                    ast.Await, ast.Yield, ast.YieldFrom, ast.With, ast.AsyncWith, ast.AsyncFor, ast.Delete)
_SAFE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_VERSION = re.compile(r"[0-9A-Za-z.+_-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The values a constant may hold that have no Python literal: non-finite floats.
_NON_FINITE = ("inf", "-inf", "nan", "-nan")


class GeneratedCodeError(SpecError):
    """The generated source is not the expected skeleton: spec text would have become
    code (or a generator bug). Nothing is compiled or written."""


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("graphslot.codegen", "templates"),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
    )
    env.filters["pyrepr"] = repr
    env.filters["pytuple"] = lambda items: repr(tuple(items))
    return env


# --- the banner: untrusted text, escaped --------------------------------------------------


def comment_text(value: Any) -> str:
    """``value`` as it may appear in a comment: an ``ascii()`` literal — one line of
    printable ASCII whatever the value holds (newlines, ``\\r``, form feeds, Unicode
    line separators and bidi controls all escaped)."""
    return ascii(value if isinstance(value, str) else str(value))


def comment_name(name: Any) -> str:
    """A name (param, slot) for a comment: as is when it is a plain ASCII identifier,
    else quoted and escaped."""
    return name if isinstance(name, str) and _SAFE_WORD.fullmatch(name) else comment_text(name)


def comment_value(value: Any) -> str:
    if isinstance(value, DTypeName) or is_torch_dtype(value):  # before str: a DTypeName is one
        return comment_name(dtype_name(value))
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return python_literal(value)
    return comment_text(value)


def params_comment(params: Mapping[str, Any]) -> str:
    shown = (f"{comment_name(k)}={comment_value(v)}" for k, v in sorted(params.items()))
    return ", ".join(shown) or "(none)"


# --- the structural check -----------------------------------------------------------------


def _refuse(spec: RegistrySpec, message: str) -> GeneratedCodeError:
    return GeneratedCodeError([SpecIssue(spec.source, None, f"refusing to generate code for spec "
                                         f"{comment_text(spec.name)}: {message}")])


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, ast.Module) else ""
    return f"line {getattr(node, 'lineno', '?')}: {comment_text(text[:80])}"


class _NonFinite(ast.NodeTransformer):
    """``float('inf')``, ``float('-inf')``, ``float('nan')``, ``float('-nan')`` -> the constant, so
    :func:`ast.literal_eval` reads them; any other call stays and is refused."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (isinstance(node.func, ast.Name) and node.func.id == "float" and not node.keywords
                and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in _NON_FINITE):
            return ast.Constant(float(node.args[0].value))
        return node


def _literal(node: ast.AST) -> Any:
    """The value of a literal, non-finite floats (as :func:`python_literal` writes them)
    included; ValueError for anything else."""
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


def _expected_constants(spec: RegistrySpec, e: Emission) -> List[Tuple[str, Any]]:
    params = _literal(ast.parse(params_literal(e.params), mode="eval").body)
    return [("SPEC_NAME", e.spec_name), ("SPEC_IDENTITY", e.spec_identity), ("GRAPHSLOT_VERSION", e.version),
            ("PARAMS", params), ("RUNTIME_PARAMS", tuple(e.runtime_params)), ("SLOTS", tuple(e.slot_names))]


def _is_handshake(node: ast.stmt, version: str | None) -> bool:
    """``__gs_rt.require(__name__, version=<literal>, format=MODULE_FORMAT)``; with
    ``version``, that very version."""
    call = node.value if isinstance(node, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "require"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == RUNTIME_ALIAS
            and len(call.args) == 1 and isinstance(call.args[0], ast.Name) and call.args[0].id == "__name__"
            and [k.arg for k in call.keywords] == ["version", "format"]
            and all(isinstance(k.value, ast.Constant) for k in call.keywords)):
        return False
    got_version, got_format = (k.value.value for k in call.keywords)
    return (isinstance(got_version, str) and (version is None or got_version == version)
            and type(got_format) is int and got_format == MODULE_FORMAT)


def check_module_structure(text: str, spec: RegistrySpec, expected: Optional[Sequence[Tuple[str, Any]]] = None
                           ) -> None:
    """Refuse ``text`` unless its top level is exactly the generated skeleton.

    ``expected``: (name, value) of every constant, in order; without it SPEC_NAME and
    SPEC_IDENTITY are checked against ``spec`` and the others only for being literals.
    Raises :class:`GeneratedCodeError` naming the first statement that does not fit.
    """
    bad = [c for c in text if c != "\n" and not c.isprintable()]
    if bad:
        raise _refuse(spec, f"the source would contain the control character {ascii(bad[0])}")
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:  # spec text broke the syntax (or a generator bug): never write it
        raise _refuse(spec, f"the generated source does not parse (line {exc.lineno}: {exc.msg}); spec text "
                            "would have become code") from None
    body = list(tree.body)
    problems: List[str] = []

    def take(kind: str, test) -> Optional[ast.stmt]:
        node = body.pop(0) if body else None
        if node is None or not test(node):
            found = _describe(node) if node is not None else "the end of the module"
            problems.append(f"expected {kind}, found {found}")
            return None
        return node

    take("the module docstring", lambda n: isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
         and n.value.value == DOCSTRING)
    if not problems:
        take(f"`from {RUNTIME_PACKAGE} import {RUNTIME_NAME} as {RUNTIME_ALIAS}`",
             lambda n: isinstance(n, ast.ImportFrom) and n.module == RUNTIME_PACKAGE and n.level == 0
             and [(a.name, a.asname) for a in n.names] == [(RUNTIME_NAME, RUNTIME_ALIAS)])
    if not problems:
        version = dict(expected or {}).get("GRAPHSLOT_VERSION")
        take(f"the handshake `{RUNTIME_ALIAS}.require(__name__, version=..., format={MODULE_FORMAT})`",
             lambda n: _is_handshake(n, version))
    if not problems:
        take("`import torch`", lambda n: isinstance(n, ast.Import)
             and [(a.name, a.asname) for a in n.names] == [("torch", None)])
    if not problems:
        take(f"`from {RUNTIME_MODULE} import (...)` of known helpers", lambda n: isinstance(n, ast.ImportFrom)
             and n.module == RUNTIME_MODULE and n.level == 0 and n.names
             and all(_HELPER_ALIASES.get(a.name) == a.asname for a in n.names))
    for position, name in enumerate(CONSTANTS):
        if problems:
            break

        def constant(n, name=name, position=position):
            if not (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                    and n.targets[0].id == name):
                return False
            try:
                value = _literal(n.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return False
            if expected is None:  # the spec's own identity, at least
                known = {"SPEC_NAME": spec.name, "SPEC_IDENTITY": spec.identity}
                return name not in known or value == known[name]
            return expected[position][0] == name and _same(expected[position][1], value)

        take(f"the constant {name} = <its literal value>", constant)
    for name in FUNCTIONS:
        if problems:
            break
        node = take(f"`def {name}(...)`", lambda n, name=name: isinstance(n, ast.FunctionDef) and n.name == name
                    and not n.decorator_list and n.returns is None)
        if node is not None:
            problems += _function_problems(node)
    if not problems and body:
        problems.append(f"unexpected statement after `def bind`, {_describe(body[0])}")
    if problems:
        raise _refuse(spec, f"the generated module is not the expected skeleton ({problems[0]}); spec "
                            "text would have become code")


def _function_problems(function: ast.FunctionDef) -> List[str]:
    problems = []
    for node in ast.walk(function):
        if isinstance(node, _FORBIDDEN_NODES):
            problems.append(f"`{type(node).__name__}` in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.Name) and (node.id in _FORBIDDEN_NAMES or (
                node.id.startswith("__") and node.id.endswith("__"))):
            problems.append(f"the name {node.id!r} in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__") and node.attr.endswith("__"):
            problems.append(f"the attribute {node.attr!r} in `def {function.name}`, {_describe(node)}")
        elif isinstance(node, ast.arguments):
            defaults = node.defaults + [d for d in node.kw_defaults if d is not None]
            if any(not isinstance(d, ast.Constant) for d in defaults) or any(
                    a.annotation is not None for a in node.args + node.posonlyargs + node.kwonlyargs):
                problems.append(f"a non-literal default or an annotation in `def {function.name}`")
        elif isinstance(node, ast.FunctionDef) and node.decorator_list:
            problems.append(f"a decorator in `def {function.name}`, {_describe(node)}")
    return problems


# --- rendering ----------------------------------------------------------------------------


def _check_emission(spec: RegistrySpec, e: Emission) -> None:
    """The few emitted values the template places as code rather than as literals."""
    if not _VERSION.fullmatch(e.version):
        raise _refuse(spec, f"graphslot version {comment_text(e.version)} is not a plain version")
    if not _SHA256.fullmatch(e.spec_identity):
        raise _refuse(spec, "the spec's identity is not a sha256 hex digest")
    for local, _ in e.used_runtime_params:
        if not (local.isidentifier() and local.isascii()):
            raise _refuse(spec, f"runtime param {comment_text(local)} is not an identifier")
    for helper, alias in e.runtime_imports:
        if _HELPER_ALIASES.get(helper) != alias:
            raise _refuse(spec, f"unknown runtime helper {comment_text(helper)}")


def render_module(
    spec: RegistrySpec,
    params: Mapping[str, Any],
    source_label: Optional[str] = None,
    regenerate: str = REGENERATE,
) -> str:
    """The generated source. Byte-stable: the same inputs give the same bytes.

    Raises :class:`GeneratedCodeError` (a :class:`SpecError`) when the source is not the
    expected skeleton; nothing returned has failed that check.
    """
    emission = Emitter(spec, params, __version__, source_label or spec.source).emit()
    _check_emission(spec, emission)
    if regenerate != REGENERATE and not re.fullmatch(r"[ -~]+", regenerate):
        raise _refuse(spec, "the regenerate command must be one line of printable ASCII")
    text = _environment().get_template("registry_module.py.j2").render(
        e=emission,
        rule=RULE,
        docstring=DOCSTRING,
        regenerate=regenerate,
        source_text=comment_text(emission.spec_source),
        name_text=comment_text(emission.spec_name),
        params_comment=params_comment(emission.params),
        runtime_comment=", ".join(comment_name(n) for n in emission.runtime_params),
        params_literal=params_literal(emission.params),
        plan_cache_limit=PLAN_CACHE_LIMIT,
        module_format=MODULE_FORMAT,
    )
    check_module_structure(text, spec, _expected_constants(spec, emission))
    return text
