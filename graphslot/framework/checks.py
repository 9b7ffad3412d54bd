"""The rules that relate a spec's keys to each other.

Each check appends :class:`SpecIssue` s instead of raising, so one run reports every
problem in a file. Checks run on the parts of a spec that passed structural (pydantic)
validation; a slot with a structural error is not checked twice.
"""

from __future__ import annotations

import keyword
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import DTYPES, parse_dtype, value_fits_dtype
from .errors import ExprError, SpecError, SpecIssue, did_you_mean
from .expr import Expr, python_type_name
from .hooks import HOOK_SIGNATURES, HookError, check_reference
from .model import PADDINGS, ParamSpec, RegistrySpec, SlotSpec
from .resolve import AXIS_CAPACITY, CAPACITY_NAMES, coerce_param, resolve_params
from .yaml_loader import Locations

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESETTING = ("zero", "fill_sentinel")
_NEEDS_PAD_VALUE = ("fill_sentinel", "fill_once")


class _Reporter:
    def __init__(self, file: str, locations: Locations):
        self.file, self.locations, self.issues = file, locations, []

    def add(self, path: Tuple[Any, ...], message: str, slot: Optional[str] = None) -> None:
        self.issues.append(SpecIssue(self.file, self.locations.line(path), message, slot))


def check_spec(
    params: Dict[str, ParamSpec],
    presets: Dict[str, Dict[str, Any]],
    slots: Sequence[Tuple[int, SlotSpec]],
    file: str,
    locations: Locations,
) -> List[SpecIssue]:
    """All cross-key problems of a spec whose structurally valid parts are given."""
    report = _Reporter(file, locations)
    types = {name: p.type for name, p in params.items()}
    _check_params(params, types, report)
    _check_presets(params, presets, report)
    default_values = _default_values(params, presets, file, locations, report)
    first_line: Dict[str, int] = {}
    for index, slot in slots:
        path = ("slots", index)
        if slot.name in first_line:
            report.add(path + ("name",), f"duplicate slot name (first at line {first_line[slot.name]})", slot.name)
        else:
            first_line[slot.name] = locations.line(path + ("name",)) or 0
        _SlotChecker(slot, path, params, types, default_values, report).run()
    return report.issues


def _check_params(params: Dict[str, ParamSpec], types: Dict[str, str], report: _Reporter) -> None:
    for name, param in params.items():
        path = ("params", name)
        if not isinstance(name, str):
            continue  # YAML read the key as a bool or number: reported by the structural check
        if not _IDENT.match(name) or keyword.iskeyword(name) or name in CAPACITY_NAMES + ("true", "false"):
            report.add(path, f"param name '{name}' must be an identifier other than "
                             f"{', '.join(CAPACITY_NAMES)}, true and false")
            continue
        default = param.default
        if isinstance(default, str) and param.type in ("int", "float", "bool"):
            # A default naming its own param is a cycle (reported with the others), not an unknown name.
            _check_expr(default, types, (param.type,), path + ("default",), report, f"default of param '{name}'")
        else:
            try:
                coerce_param(name, param.type, default)
            except ValueError:
                report.add(path + ("default",), f"default of param '{name}' must be {_kind(param.type)}, "
                                                f"got {default!r}" + _dtype_hint(param.type, default))
        if param.runtime and param.type not in ("int", "float", "bool"):
            report.add(path + ("runtime",), f"runtime param '{name}' must be int, float or bool")


def _check_presets(params: Dict[str, ParamSpec], presets: Dict[str, Dict[str, Any]], report: _Reporter) -> None:
    for preset, values in presets.items():
        for name, value in values.items():
            if not isinstance(name, str):
                continue  # reported by the structural check
            path = ("presets", preset, name)
            if name not in params:
                report.add(path, f"preset '{preset}' sets unknown param '{name}'" + did_you_mean(name, params))
                continue
            try:
                coerce_param(name, params[name].type, value)
            except ValueError as exc:
                report.add(path, f"preset '{preset}': {exc}")


def _default_values(params, presets, file, locations, report) -> List[Dict[str, Any]]:
    """Param values under the defaults and under each preset, for evaluating extents."""
    if report.issues:
        return []
    probe = RegistrySpec.model_construct(name="", params=params, presets=presets, slots=[])
    probe._source, probe._locations = file, locations
    sets = []
    for preset in [None, *presets]:
        try:
            sets.append(resolve_params(probe, preset=preset))
        except SpecError as exc:
            report.issues.extend(exc.issues)
            return []
    return sets


def _kind(ptype: str) -> str:
    return {"int": "an int", "float": "a number", "bool": "true or false", "str": "a string",
            "dtype": "a torch dtype name"}[ptype]


def _dtype_hint(ptype: str, value: Any) -> str:
    return did_you_mean(value, DTYPES) if ptype == "dtype" and isinstance(value, str) else ""


def _check_expr(text: str, types: Dict[str, str], want: Tuple[str, ...], path, report, what: str,
                slot: Optional[str] = None) -> Optional[Expr]:
    try:
        expr = Expr.parse(text)
        got = expr.infer_type(types)
    except ExprError as exc:
        report.add(path, f"{what}: {exc}", slot)
        return None
    if got not in want and not (got == "int" and "float" in want):
        report.add(path, f"{what} must be {' or '.join(want)}, but '{text}' is {got}", slot)
        return None
    return expr


class _SlotChecker:
    def __init__(self, slot: SlotSpec, path, params, types, default_values, report: _Reporter):
        self.slot, self.path, self.params, self.report = slot, path, params, report
        self.types, self.default_values = types, default_values
        self.runtime = {n for n, p in params.items() if p.runtime}

    def add(self, key: Optional[str], message: str) -> None:
        path = self.path if key is None else self.path + (key,)
        self.report.add(path, message, self.slot.name)

    def run(self) -> None:
        for check in (self.name, self.dtype, self.shape, self.padding, self.pad_value,
                      self.enabled_if, self.hooks):
            check()

    def structural_types(self) -> Dict[str, str]:
        """Names a shape, dtype or enabled_if may use: runtime params are not baked."""
        return {k: v for k, v in self.types.items() if k not in self.runtime}

    def name(self) -> None:
        slot = self.slot
        if not all(_IDENT.match(part) for part in slot.name.split(".")):
            self.add("name", "slot names are identifiers, or dotted identifiers for structured slots")
        if slot.is_structured and slot.source is None:
            self.add("name", "a dotted (structured) slot needs a 'source' hook to read its value, "
                             "e.g. source: dotted_field")

    def dtype(self) -> None:
        dtype = self.slot.dtype
        if dtype in self.params:
            if self.params[dtype].type != "dtype":
                self.add("dtype", f"param '{dtype}' is {self.params[dtype].type}, not a dtype")
        elif parse_dtype(dtype) is None:
            dtype_params = [n for n, p in self.params.items() if p.type == "dtype"]
            self.add("dtype", f"unknown dtype '{dtype}': use a torch dtype name (int64, int32, bool, "
                              f"float32, bfloat16, …) or a dtype param" + did_you_mean(dtype, list(DTYPES) + dtype_params))

    def uses_runtime(self, text: str, key: str, what: str) -> bool:
        """Report (and say whether) an expression that must be baked names a runtime param."""
        try:
            used = sorted(Expr.parse(text).names & self.runtime)
        except ExprError:
            return False  # _check_expr reports the syntax
        if used:
            self.add(key, f"{what} uses runtime param '{used[0]}': runtime params are passed at fill time, "
                          "so only pad values may use them")
        return bool(used)

    def shape(self) -> None:
        slot = self.slot
        types = dict(self.structural_types(), **{n: "int" for n in CAPACITY_NAMES})
        for d, extent in enumerate(slot.shape):
            where = ("shape",)
            if isinstance(extent, str):
                if self.uses_runtime(extent, "shape", f"shape[{d}]"):
                    continue
                expr = _check_expr(extent, types, ("int",), self.path + where, self.report,
                                   f"shape[{d}]", slot.name)
                if expr is None or expr.names & set(CAPACITY_NAMES):
                    continue
                for values in self.default_values:
                    n = expr.evaluate(values)
                    if n < 1:
                        self.add("shape", f"shape[{d}] = '{extent}' evaluates to {n}; extents must be positive")
                        break
            elif extent < 1:
                self.add("shape", f"shape[{d}] is {extent}; extents must be positive")
        if not 0 <= slot.slice_dim < len(slot.shape):
            self.add("slice_dim", f"slice_dim {slot.slice_dim} is beyond the shape {list(slot.shape)} "
                                  f"(it has {len(slot.shape)} dimension(s))")
        elif slot.axis in AXIS_CAPACITY:
            capacity = AXIS_CAPACITY[slot.axis]
            extent = slot.shape[slot.slice_dim]
            if not (isinstance(extent, str) and extent.strip() == capacity):
                self.add("shape", f"axis '{slot.axis}' slices dimension {slot.slice_dim}, so that extent "
                                  f"must be '{capacity}' (the buffer's capacity), got {extent!r}")

    def padding(self) -> None:
        slot = self.slot
        if slot.axis == "none":
            if slot.padding in _RESETTING:
                self.add("padding", f"axis 'none' is never sliced, so padding '{slot.padding}' would never "
                                    "reset anything; use keep_pad, or fill_once to initialise the buffer")
        elif slot.padding is None:
            self.add(None, f"missing 'padding': a '{slot.axis}'-axis slot must say how its padded tail is "
                           f"made safe (one of {', '.join(PADDINGS)})")
        if slot.index and slot.padding != "zero":
            self.add("index", f"index slots must use padding 'zero' (got '{slot.padding or 'keep_pad'}'): "
                              "a stale or sentinel tail would index out of the pool")

    def pad_value(self) -> None:
        slot = self.slot
        needs = slot.padding in _NEEDS_PAD_VALUE
        if needs and slot.pad_value is None:
            self.add(None, f"padding '{slot.padding}' needs a 'pad_value'")
        elif not needs and slot.pad_value is not None:
            self.add("pad_value", f"pad_value is only used by fill_sentinel and fill_once, not "
                                  f"'{slot.padding or 'keep_pad'}'; remove it or change the padding")
        if slot.pad_value is None or not needs:
            return
        if isinstance(slot.pad_value, str):
            if _check_expr(slot.pad_value, self.types, ("int", "float", "bool"), self.path + ("pad_value",),
                           self.report, "pad_value", slot.name) is None:
                return
        for values in self.default_values:
            dtype = values[slot.dtype] if slot.dtype in values else parse_dtype(slot.dtype)
            if dtype is None:
                return
            value = Expr.parse(slot.pad_value).evaluate(values) if isinstance(slot.pad_value, str) else slot.pad_value
            if not value_fits_dtype(value, dtype):
                self.add("pad_value", f"pad_value {value!r} ({python_type_name(value)}) does not fit dtype "
                                      f"{str(dtype).removeprefix('torch.')}")
                return

    def enabled_if(self) -> None:
        cond = self.slot.enabled_if
        if isinstance(cond, str) and not self.uses_runtime(cond, "enabled_if", "enabled_if"):
            _check_expr(cond, self.structural_types(), ("bool",), self.path + ("enabled_if",), self.report,
                        "enabled_if", self.slot.name)

    def hooks(self) -> None:
        slot = self.slot
        for kind in HOOK_SIGNATURES:
            ref = getattr(slot, kind)
            if ref is None:
                continue
            try:
                check_reference(ref, kind)
            except HookError as exc:
                self.add(kind, str(exc))
        if slot.source is not None and not slot.copy_from_fb:
            self.add("source", "a source hook only feeds the copy, and copy_from_fb is false; remove one")
