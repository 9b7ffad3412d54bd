"""The checks of a spec's params and presets (names, defaults, types, chains of defaults,
preset values), and the reporter and expression check every check uses: each appends
:class:`SpecIssue` s instead of raising, so one run reports every problem in a file."""

from __future__ import annotations

import keyword
from typing import Any, Dict, List, Optional, Tuple

from .dtypes import dtype_hint
from .errors import ExprError, SpecError, SpecIssue, did_you_mean, shorten
from .expr import Expr
from .kinds import CAPACITY_NAMES
from .model import ParamSpec, RegistrySpec
from .names import char_name, control_character, is_identifier
from .resolve import coerce_param, resolve_params
from .yaml_loader import Locations

# Longest chain of param defaults naming each other (a -> b -> c is 3).
MAX_PARAM_CHAIN = 64
KIND_OF = {
    "int": "an int",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "dtype": "a torch dtype name",
}


class Reporter:
    def __init__(self, file: str, locations: Locations):
        self.file, self.locations, self.issues = file, locations, []

    def add(self, path: Tuple[Any, ...], message: str, slot: Optional[str] = None) -> None:
        self.issues.append(SpecIssue(self.file, self.locations.line(path), message, slot))


def check_expr(
    text: str, types: Dict[str, str], want: Tuple[str, ...], path, report, what: str, slot: Optional[str] = None
) -> Optional[Expr]:
    try:
        expr = Expr.parse(text)
        got = expr.infer_type(types)
    except ExprError as exc:
        report.add(path, f"{what}: {exc}", slot)
        return None
    if got not in want and not (got == "int" and "float" in want):
        report.add(path, f"{what} must be {' or '.join(want)}, but '{shorten(text, quote=False)}' is {got}", slot)
        return None
    return expr


def check_no_live(
    text: str, params: Dict[str, ParamSpec], path, report: Reporter, what: str, slot: Optional[str] = None
) -> bool:
    """Report (and say whether) an expression names a live param: live params are
    evaluated at fill time, and only hooks may read them."""
    try:
        used = sorted(n for n in Expr.parse(text).names if n in params and params[n].live)
    except ExprError:
        return False  # the syntax is reported where the expression is checked
    if used:
        report.add(
            path,
            f"{what} uses live param '{used[0]}': live params are evaluated at fill time by the "
            "hooks that read them (ctx.params), so shapes, dtypes, enabled_if, pad values and "
            "other params' defaults cannot use them",
            slot,
        )
    return bool(used)


def check_param_chains(params: Dict[str, ParamSpec], report: Reporter) -> bool:
    """Report default chains longer than MAX_PARAM_CHAIN (resolving them recurses)."""
    deps: Dict[str, List[str]] = {}
    for name, param in params.items():
        deps[name] = []
        if isinstance(param.default, str) and param.type in ("int", "float", "bool"):
            try:
                deps[name] = sorted(Expr.parse(param.default).names & params.keys())
            except ExprError:
                pass
    depth: Dict[str, int] = {}

    def too_long(name: str, path: Tuple[str, ...]) -> Optional[str]:
        """The param to report for a chain longer than MAX_PARAM_CHAIN from ``path``, else None
        (a cycle is reported by resolve_params); at most MAX_PARAM_CHAIN + 1 calls deep."""
        if len(path) > MAX_PARAM_CHAIN:
            return path[0]
        for child in deps[name]:
            found = None if child in path or child in depth else too_long(child, path + (child,))
            if found is not None:
                return found
        depth[name] = 1 + max((depth.get(c, 0) for c in deps[name]), default=0)
        return name if depth[name] > MAX_PARAM_CHAIN else None

    for start in params:
        bad = None if start in depth else too_long(start, (start,))
        if bad is not None:
            report.add(
                ("params", bad, "default"),
                f"param '{bad}': its default depends on a chain of more than {MAX_PARAM_CHAIN} param defaults; a "
                "default may name a param whose default names another, but not that deeply",
            )
            return False
    return True


def check_params(params: Dict[str, ParamSpec], types: Dict[str, str], report: Reporter) -> None:
    for name, param in params.items():
        path = ("params", name)
        if not isinstance(name, str):
            continue  # YAML read the key as a bool or number: reported by the structural check
        if not is_identifier(name) or keyword.iskeyword(name) or name in CAPACITY_NAMES + ("true", "false"):
            report.add(
                path,
                f"param name {shorten(name)} must be an identifier other than "
                f"{', '.join(CAPACITY_NAMES)}, true and false",
            )
            continue
        if name.startswith("__"):
            report.add(
                path, f"param name {shorten(name)} may not start with '__': generated code keeps '__' names for itself"
            )
            continue
        default = param.default
        if isinstance(default, str) and param.type in ("int", "float", "bool"):
            # A default naming its own param is a cycle (reported with the others), not an unknown name.
            check_expr(default, types, (param.type,), path + ("default",), report, f"default of param '{name}'")
        else:
            try:
                coerce_param(name, param.type, default)
            except ValueError:
                report.add(
                    path + ("default",),
                    f"default of param '{name}' must be {KIND_OF[param.type]}, got {shorten(default)}"
                    + (dtype_hint(default) if param.type == "dtype" else ""),
                )
            else:
                bad = control_character(default) if isinstance(default, str) else None
                if bad is not None:
                    report.add(
                        path + ("default",),
                        f"default of param '{name}' contains the control character {char_name(bad)}",
                    )
        if param.runtime and param.type not in ("int", "float", "bool"):
            report.add(path + ("runtime",), f"runtime param '{name}' must be int, float or bool")
        if param.live and param.runtime:
            report.add(
                path + ("live",),
                f"param '{name}' cannot be both runtime and live: a runtime param is "
                "bound with the registry, a live one read by hooks at each fill",
            )
        elif param.live and param.type == "dtype":
            report.add(
                path + ("live",),
                f"live param '{name}' must be int, float, bool or str: a dtype decides "
                "what is allocated, and live params are read only by hooks",
            )
        if isinstance(default, str) and param.type in ("int", "float", "bool"):
            check_no_live(default, params, path + ("default",), report, f"the default of param '{name}'")


def check_presets(params: Dict[str, ParamSpec], presets: Dict[str, Dict[str, Any]], report: Reporter) -> None:
    for preset, values in presets.items():
        shown = shorten(str(preset), quote=False)
        if control_character(str(preset)) is not None:
            report.add(("presets", preset), f"preset name {shorten(preset)} contains a control character")
            continue
        for name, value in values.items():
            if not isinstance(name, str):
                continue  # reported by the structural check
            path = ("presets", preset, name)
            if name not in params:
                report.add(path, f"preset '{shown}' sets unknown param {shorten(name)}" + did_you_mean(name, params))
                continue
            try:
                coerce_param(name, params[name].type, value)
            except ValueError as exc:
                report.add(path, f"preset '{shown}': " + str(exc).replace(repr(value), shorten(value)))
                continue
            bad = control_character(value) if isinstance(value, str) else None
            if bad is not None:
                report.add(
                    path,
                    f"preset '{shown}': the value of param '{name}' contains the control character {char_name(bad)}",
                )


def param_value_sets(params, presets, file, locations, report) -> List[Dict[str, Any]]:
    """Param values under the defaults and under each preset, for evaluating extents."""
    if report.issues:
        return []
    probe = RegistrySpec.model_construct(name="", params=params, presets=presets, slots=[])
    probe._source, probe._locations = file, locations
    sets = []
    for preset in [None, *presets]:
        try:
            sets.append(resolve_params(probe, preset=preset, torch_dtypes=False))
        except SpecError as exc:
            report.issues.extend(exc.issues)
            return []
    return sets
