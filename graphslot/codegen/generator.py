"""Render the generated module for one (spec, params), and check it before use.

Spec text (and pyproject's) is untrusted: it reaches the banner only as ``ascii()`` literals, code only as
escaped string literals (:func:`.layout.py_str`). Then :func:`check_module_structure` refuses any source whose
top level is not exactly: the fixed docstring, the runtime import, the handshake, ``torch`` and known helpers
bound from the runtime, the constants SPEC_NAME … SPEC_JSON as literals, then ``def allocate`` and ``def bind``
(in which nothing imports, declares globals, defines classes or reaches for ``eval``-like names or any dunder).
"""

from __future__ import annotations

import ast
import copy
import re
from functools import lru_cache
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import jinja2

from .._version import __version__
from ..spec.dtypes import DTypeName, dtype_name, is_torch_dtype
from ..spec.errors import SpecError, SpecIssue
from ..spec.expr import python_literal
from ..spec.model import RegistrySpec
from .emitter import PLAN_CACHE_LIMIT, Emitter as Emitter, params_literal
from .handshake import MODULE_FORMAT
from .layout import py_str
from .names import RUNTIME_HELPERS

DOCSTRING = "Specialised fill_from / extract for one slot spec: see SPEC_NAME and the banner."
CONSTANTS = tuple("SPEC_NAME SPEC_IDENTITY GRAPHSLOT_VERSION PARAMS RUNTIME_PARAMS SLOTS SPEC_SOURCE SPEC_JSON".split())
RUNTIME_ALIAS = "__gs_rt"
RUNTIME_IMPORT = "from graphslot.codegen import runtime as __gs_rt"
HELPER_ALIASES = dict(RUNTIME_HELPERS)

# Inside the functions: so even spec text that slipped into an expression could do nothing
# but arithmetic and tensor calls.
_FORBIDDEN_NAMES = frozenset(
    "__import__ __builtins__ __loader__ __spec__ eval exec compile open globals locals vars breakpoint input help "
    "exit quit delattr memoryview classmethod staticmethod property super type object".split()
)
_FORBIDDEN_NODES = tuple(getattr(ast, n) for n in "Import ImportFrom Global Nonlocal ClassDef AsyncFunctionDef".split())
_FORBIDDEN_NODES += tuple(getattr(ast, n) for n in "Await Yield YieldFrom With AsyncWith AsyncFor Delete".split())
# The constant values with no Python literal: non-finite floats, written as calls.
_NON_FINITE = {ast.dump(ast.parse(f'float("{v}")', mode="eval").body): float(v) for v in ("inf", "-inf", "nan", "-nan")}


class GeneratedCodeError(SpecError):
    """The generated source is not the expected skeleton: nothing is compiled or written."""


def refuse(spec: RegistrySpec, message: str) -> GeneratedCodeError:
    message = f"refusing to generate code for spec {ascii(str(spec.name))}: {message}"
    return GeneratedCodeError([SpecIssue(spec.path, None, message)])


def _describe(node: ast.AST) -> str:
    return f"line {node.lineno}: {ascii(ast.unparse(node).splitlines()[0][:80])}"


class _NonFinite(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        value = _NON_FINITE.get(ast.dump(node))
        return node if value is None else ast.Constant(value)


def literal(node: ast.AST) -> Any:
    """The value of a literal, non-finite floats (``float("inf")``) included; ValueError for anything else."""
    return ast.literal_eval(_NonFinite().visit(copy.deepcopy(node)))


def _is(node: ast.stmt, text: str) -> bool:
    """``node`` is the one statement ``text`` parses to."""
    return ast.dump(node) == ast.dump(ast.parse(text).body[0])


def _is_handshake(node: ast.stmt, version: Optional[str]) -> bool:
    """``__gs_rt.require(__name__, version=<str literal>, format=MODULE_FORMAT)``; with ``version``, that one."""
    handshake = rf"{RUNTIME_ALIAS}\.require\(__name__, version=('[^'\\]*'), format={MODULE_FORMAT}\)"
    match = re.fullmatch(handshake, ast.unparse(node))
    return match is not None and version in (None, ast.literal_eval(match.group(1)))


def _bound_from_runtime(node: ast.stmt) -> Optional[Tuple[str, str]]:
    """(name, attribute) of ``name = __gs_rt.attribute``, else None."""
    match = re.fullmatch(rf"(\w+) = {RUNTIME_ALIAS}\.(\w+)", ast.unparse(node))
    return match and match.groups()


def _constant(node: ast.stmt, name: str, known: Mapping[str, str]) -> bool:
    """``name = <a literal>``; for a name ``known`` holds, the literal whose tree (``ast.dump``) it holds."""
    targets = getattr(node, "targets", None)
    if not (isinstance(node, ast.Assign) and len(targets) == 1 and getattr(targets[0], "id", None) == name):
        return False
    if name in known:  # same types, floats by sign too (-0.0 is not 0.0, float("-nan") not float("nan"))
        return ast.dump(node.value) == known[name]
    try:
        literal(node.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def check_module_structure(text: str, spec: RegistrySpec, expected: Optional[Sequence[Tuple[str, str]]] = None) -> None:
    """Refuse ``text`` unless its top level is exactly the generated skeleton. ``expected``: (name, source) of every
    constant, in order; without it SPEC_NAME, SPEC_IDENTITY and SPEC_JSON are checked, the others only as literals."""
    if not text.replace("\n", "").isprintable():  # one pass in C; the loop only to name the character
        bad = next(c for c in text if c != "\n" and not c.isprintable())
        raise refuse(spec, f"the source would contain the control character {ascii(bad)}")
    try:
        body = ast.parse(text).body
    except SyntaxError as exc:  # spec text broke the syntax (or a generator bug): never write it
        message = f"the generated source does not parse (line {exc.lineno}: {exc.msg})"
        raise refuse(spec, f"{message}; spec text would have become code") from None
    problems: List[str] = []

    def take(kind: str, test: Callable[[ast.stmt], bool]) -> Optional[ast.stmt]:
        node = body.pop(0) if body and not problems else None
        if node is not None and test(node):
            return node
        if not problems:
            problems.append(f"expected {kind}, found {_describe(node) if node else 'the end of the module'}")
        return None

    take("the module docstring", lambda n: _is(n, repr(DOCSTRING)))
    take(f"`{RUNTIME_IMPORT}`", lambda n: _is(n, RUNTIME_IMPORT))
    own = {"SPEC_NAME": repr(spec.name), "SPEC_IDENTITY": repr(spec.identity), "SPEC_JSON": repr(spec.canonical_json())}
    known = {k: ast.dump(ast.parse(v, mode="eval").body) for k, v in (expected or own.items())}
    version = ast.literal_eval(dict(expected)["GRAPHSLOT_VERSION"]) if expected else None
    handshake = f"the handshake `{RUNTIME_ALIAS}.require(__name__, version=..., format={MODULE_FORMAT})`"
    take(handshake, lambda n: _is_handshake(n, version))
    take(f"`torch = {RUNTIME_ALIAS}.torch`", lambda n: _bound_from_runtime(n) == ("torch", "torch"))
    seen = set()

    def helper(n: ast.stmt) -> bool:
        bound = _bound_from_runtime(n)
        ok = bound is not None and bound not in seen and HELPER_ALIASES.get(bound[1]) == bound[0]
        seen.add(bound)
        return ok

    take(f"`<helper> = {RUNTIME_ALIAS}.<helper>` of a known helper", helper)  # one or more, each bound once
    while not problems and body and _bound_from_runtime(body[0]):
        take(f"`<helper> = {RUNTIME_ALIAS}.<helper>` of a known helper", helper)
    for name in CONSTANTS:  # without ``expected``, the spec's own identity at least
        take(f"the constant {name} = <its literal value>", lambda n, name=name: _constant(n, name, known))
    for name in ("allocate", "bind"):
        node = take(
            f"`def {name}(...)`",
            lambda n, name=name: (
                isinstance(n, ast.FunctionDef) and n.name == name and not n.decorator_list and n.returns is None
            ),
        )
        problems += _function_problems(node) if node else []
    if not problems and body:
        problems.append(f"unexpected statement after `def bind`, {_describe(body[0])}")
    if problems:
        message = f"the generated module is not the expected skeleton ({problems[0]})"
        raise refuse(spec, f"{message}; spec text would have become code")


def _function_problems(function: ast.FunctionDef) -> List[str]:
    problems = []
    where = f"in `def {function.name}`"
    for node in ast.walk(function):
        if isinstance(node, _FORBIDDEN_NODES):
            problems.append(f"`{type(node).__name__}` {where}, {_describe(node)}")
        elif isinstance(node, ast.Name) and (node.id in _FORBIDDEN_NAMES or node.id[:2] == node.id[-2:] == "__"):
            problems.append(f"the name {node.id!r} {where}, {_describe(node)}")
        elif isinstance(node, ast.Attribute) and node.attr[:2] == node.attr[-2:] == "__":
            problems.append(f"the attribute {node.attr!r} {where}, {_describe(node)}")
        elif isinstance(node, ast.arguments):
            defaults = node.defaults + [d for d in node.kw_defaults if d is not None]
            arguments = node.args + node.posonlyargs + node.kwonlyargs
            if any(not isinstance(d, ast.Constant) for d in defaults) or any(a.annotation for a in arguments):
                problems.append(f"a non-literal default or an annotation {where}")
        elif isinstance(node, ast.FunctionDef) and node.decorator_list:
            problems.append(f"a decorator {where}, {_describe(node)}")
    return problems


REGENERATE = "graphslot generate"
RULE = "-" * 86
_SAFE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    options = dict(keep_trailing_newline=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env = jinja2.Environment(loader=jinja2.PackageLoader("graphslot.codegen", "templates"), **options)
    env.globals.update(docstring=DOCSTRING, plan_cache_limit=PLAN_CACHE_LIMIT, module_format=MODULE_FORMAT)
    return env.get_template("registry_module.py.j2")


def comment_text(value: Any) -> str:
    """``value`` for a comment: an ``ascii()`` literal, one line of printable ASCII whatever it holds."""
    return ascii(value if isinstance(value, str) else str(value))


def comment_name(name: Any) -> str:
    """A name for a comment: as is when a plain ASCII identifier, else quoted and escaped."""
    return name if isinstance(name, str) and _SAFE_WORD.fullmatch(name) else comment_text(name)


def comment_value(value: Any) -> str:
    if isinstance(value, DTypeName) or is_torch_dtype(value):  # before str: a DTypeName is one
        return comment_name(dtype_name(value))
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return python_literal(value)
    return comment_text(value)


def banner_lines(e: Any) -> List[str]:
    """Where the module comes from, one param a line (a changed param changes one line)."""
    lines = [f"# {RULE}", f"# Generated by graphslot {e.version} from {comment_text(e.source_label)}. DO NOT EDIT."]
    lines += [f"# spec:     {comment_text(e.spec.name)}", f"# identity: {e.spec.identity}"]
    params = [f"{comment_name(k)}={comment_value(v)}" for k, v in sorted(e.baked.items())]
    runtime = [comment_name(n) for n in e.runtime]
    live = [comment_name(n) for n, p in sorted(e.spec.params.items()) if p.live]
    for label, items in (
        ("params:   ", params or ["(none)"]),
        ("runtime:  ", [*runtime, "(read from params when bound)"] if runtime else []),
        ("live:     ", [*live, "(read by hooks at each fill)"] if live else []),
    ):
        lines += [f"# {label if i == 0 else ' ' * len(label)}{item}" for i, item in enumerate(items)]
    return lines + [f"# Regenerate with: {REGENERATE}", f"# {RULE}"]


def _expected_constants(spec: RegistrySpec, e: Any) -> List[Tuple[str, str]]:
    """(name, source) of each constant, written apart from the emitter's (``repr``, :func:`params_literal`)."""
    return [
        ("SPEC_NAME", repr(e.spec.name)),
        ("SPEC_IDENTITY", repr(e.spec.identity)),
        ("GRAPHSLOT_VERSION", repr(e.version)),
        ("PARAMS", params_literal(e.baked)),
        ("RUNTIME_PARAMS", repr(tuple(e.runtime))),
        ("SLOTS", repr(tuple(n.slot.name for n in e.names))),
        ("SPEC_SOURCE", repr(e.source_label)),
        ("SPEC_JSON", repr(spec.canonical_json())),
    ]


def render_module(spec: RegistrySpec, params: Mapping[str, Any], source_label=None, skip=()):
    """The generated source, byte-stable; :class:`GeneratedCodeError` unless it is the expected skeleton.
    ``skip``: slots its ``fill_from`` leaves alone (``fill_from_skipping``'s variant; never written out)."""
    emission = Emitter(spec, params, __version__, source_label or spec.path, skip).emit()
    text = _template().render(e=emission, banner=banner_lines(emission), version=py_str(emission.version))
    check_module_structure(text, spec, _expected_constants(spec, emission))
    return text
