"""The rules that relate a spec's keys to each other, run on the parts of a spec that passed
structural (pydantic) validation: the params' and presets' (here), each slot's
(:mod:`.slot_checks`), then the spec's total bytes. Every problem is reported."""

from __future__ import annotations

import keyword
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import dtype_hint
from .errors import ExprError, SpecError, SpecIssue, did_you_mean, shorten
from .kinds import CAPACITY_NAMES
from .expr import Expr
from .model import ParamSpec, RegistrySpec, SlotSpec
from .names import char_name, control_character, is_identifier
from .resolve import coerce_param, evaluate_field, resolve_params, slot_dtype
from .slot_checks import MAX_RANK as MAX_RANK, RESERVED_SLOT_NAMES as RESERVED_SLOT_NAMES
from .slot_checks import Reporter, SlotChecker, check_expr, check_no_live
from .yaml_loader import Locations

# The cap on the bytes a spec may declare, summed over its enabled slots at
# VALIDATION_CAPACITIES, under the defaults and under each preset. Override per call
# (parse_spec/load_spec(max_bytes=N), `graphslot validate --max-bytes N`).
DEFAULT_MAX_BYTES = 4 << 30
VALIDATION_CAPACITIES = dict.fromkeys(CAPACITY_NAMES, 256)
# Longest chain of param defaults naming each other (a -> b -> c is 3).
MAX_PARAM_CHAIN = 64
KIND_OF = dict(int="an int", float="a number", bool="true or false", str="a string", dtype="a torch dtype name")


def check_spec(
    params: Dict[str, ParamSpec],
    presets: Dict[str, Dict[str, Any]],
    slots: Sequence[Tuple[int, SlotSpec]],
    file: str,
    locations: Locations,
    *,
    name: Any = None,
    descriptions: Sequence[Tuple[Tuple[Any, ...], Any]] = (),
    import_hooks: bool = False,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
    structurally_valid: bool = False,
) -> List[SpecIssue]:
    """All cross-key problems of a spec whose structurally valid parts are given (see
    :func:`.load_spec` for ``import_hooks``); ``max_bytes`` (None: no cap) is checked only on
    a ``structurally_valid`` spec without other problems."""
    report = Reporter(file, locations)
    if isinstance(name, str) and not is_identifier(name):
        report.add(
            ("name",),
            f"spec name {shorten(name)} must be an identifier (letters, digits, '_'; "
            "not starting with a digit): generated module names are made from it",
        )
    for path, text in descriptions:
        bad = control_character(text, allow="\n\t")
        if bad is not None:
            message = f"description contains the control character {char_name(bad)}; only newlines and tabs are allowed"
            report.add(path, message)
    types = {n: p.type for n, p in params.items()}
    check_params(params, types, report)
    check_presets(params, presets, report)
    check_param_chains(params, report)
    default_values = []  # param values under the defaults and under each preset, for evaluating extents
    if not report.issues:
        probe = RegistrySpec.model_construct(name="", params=params, presets=presets, slots=[])
        probe._source, probe._locations = file, locations
        try:
            default_values = [resolve_params(probe, preset=p, torch_dtypes=False) for p in [None, *presets]]
        except SpecError as exc:
            report.issues.extend(exc.issues)
    first_line: Dict[str, int] = {}
    for index, slot in slots:
        path = ("slots", index)
        if slot.name in first_line:
            message = f"duplicate slot name (first at line {first_line[slot.name]})"
            report.add(path + ("name",), message, shorten(slot.name, quote=False))
        else:
            first_line[slot.name] = locations.line(path + ("name",)) or 0
        SlotChecker(slot, path, params, types, default_values, report, import_hooks).run()
    if structurally_valid and not report.issues and max_bytes is not None:
        _check_total_bytes(slots, presets, default_values, max_bytes, report)
    return report.issues


def _check_total_bytes(slots, presets, default_values, max_bytes: int, report: Reporter) -> None:
    """The bytes the enabled slots take at VALIDATION_CAPACITIES, under every param set."""
    caps = VALIDATION_CAPACITIES
    where = ", ".join(f"{k}={v}" for k, v in caps.items())
    for preset, values in zip([None, *presets], default_values):
        env = dict(values, **caps)
        total, largest = 0, (0, "")
        for index, slot in slots:
            try:
                if slot.enabled_if is not None and not evaluate_field(slot.enabled_if, values):
                    continue
                numel = 1
                for extent in slot.shape:
                    numel *= max(int(evaluate_field(extent, env)), 0)
            except ExprError as exc:
                report.add(("slots", index, "shape"), f"shape at {where}: {exc}", slot.name)
                return
            nbytes = max(numel, 0) * slot_dtype(slot, values).itemsize
            total += nbytes
            largest = max(largest, (nbytes, slot.name))
        if total > max_bytes:
            under = "" if preset is None else f" with preset '{shorten(str(preset), quote=False)}'"
            report.add(
                ("slots",),
                f"the enabled slots take {total} bytes at {where}{under}, more than the "
                f"limit of {max_bytes} bytes (largest: slot '{largest[1]}', {largest[0]} "
                "bytes); raise it with `graphslot validate --max-bytes N` or "
                "load_spec(..., max_bytes=N)",
            )
            return


def check_param_chains(params: Dict[str, ParamSpec], report: Reporter) -> None:
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
            return


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
