"""Render the generated module for one (spec, params): source text, checked to parse."""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Any, Mapping, Optional

import jinja2
import torch

from .._version import __version__
from ..framework.dtypes import dtype_name
from ..framework.model import RegistrySpec
from .emitter import PLAN_CACHE_LIMIT, Emitter, params_literal

REGENERATE = "graphslot generate"
_RULE = "-" * 86


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


def _params_comment(params: Mapping[str, Any]) -> str:
    shown = (f"{k}={dtype_name(v) if isinstance(v, torch.dtype) else v}" for k, v in sorted(params.items()))
    return ", ".join(shown) or "(none)"


def render_module(
    spec: RegistrySpec,
    params: Mapping[str, Any],
    source_label: Optional[str] = None,
    regenerate: str = REGENERATE,
) -> str:
    """The generated source. Byte-stable: the same inputs give the same bytes."""
    emission = Emitter(spec, params, __version__, source_label or spec.source).emit()
    text = _environment().get_template("registry_module.py.j2").render(
        e=emission,
        rule=_RULE,
        regenerate=regenerate,
        params_comment=_params_comment(emission.params),
        params_literal=params_literal(emission.params),
        plan_cache_limit=PLAN_CACHE_LIMIT,
    )
    try:
        ast.parse(text)
    except SyntaxError as exc:  # a generator bug, never a user error: fail before writing
        raise RuntimeError(f"graphslot generated invalid Python for spec '{spec.name}' "
                           f"(line {exc.lineno}: {exc.msg}); please report this") from exc
    return text
