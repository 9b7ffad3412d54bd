"""The rules that relate a spec's keys to each other, run on the parts of a spec that passed
structural (pydantic) validation: the params', the presets', each slot's, then the spec's total
bytes. Each check appends a :class:`SpecIssue` instead of raising, so every problem is reported."""

from __future__ import annotations

import keyword
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import dtype_hint, parse_dtype, value_fits_dtype
from .errors import ExprError, SpecError, SpecIssue, did_you_mean, shorten
from .expr import Expr, python_type_name
from .hooks import HOOK_SIGNATURES, HookError, check_reference, is_import_reference
from .kinds import CAPACITY_NAMES, Axis, Padding
from .model import ParamSpec, RegistrySpec, SlotSpec
from .names import DOTTED, IMPORT_REFERENCE, char_name, control_character, is_identifier
from .policy import CHOICES, choice_param, tail_issues
from .resolve import MAX_PARAM_CHAIN, coerce_param, evaluate_field, resolve_params, slot_dtype, too_long_chain
from .yaml_loader import Locations

# The cap on the bytes a spec may declare, summed over its enabled slots at
# VALIDATION_CAPACITIES, under the defaults and under each preset. Override per call
# (parse_spec/load_spec(max_bytes=N), `graphslot validate --max-bytes N`).
DEFAULT_MAX_BYTES = 4 << 30
VALIDATION_CAPACITIES = dict.fromkeys(CAPACITY_NAMES, 256)
KIND_OF = dict(int="an int", float="a number", bool="true or false", str="a string", dtype="a torch dtype name")
# Most dimensions a slot's shape may have.
MAX_RANK = 16
# Attributes extract sets besides the slots' own.
RESERVED_SLOT_NAMES = ("batch_size",)
# Why an expression that is baked in cannot use a param of this kind.
NOT_BAKED = {
    "live": "live params are evaluated at fill time by the hooks that read them (ctx.params), so shapes, dtypes, "
    "enabled_if, pad values and other params' defaults cannot use them",
    "runtime": "runtime params are passed at fill time, so only pad values may use them",
}


class Reporter:
    """Collects the issues of one file; its expression checks report rather than raise."""

    def __init__(self, file: str, locations: Locations):
        self.file = file
        self.locations = locations
        self.issues = []

    def add(self, path: Tuple[Any, ...], message: str, slot: Optional[str] = None) -> None:
        self.issues.append(SpecIssue(self.file, self.locations.line(path), message, slot))

    def control(self, path, text: Any, what: str, allow: str = "", why: str = "") -> None:
        bad = control_character(text, allow) if isinstance(text, str) else None
        if bad is not None:
            self.add(path, f"{what} contains the control character {char_name(bad)}{why}")

    def expr(self, path, text: str, types: Dict[str, str], want: Tuple[str, ...], what: str, slot=None):
        """The parsed expression, or None (reported) when it is malformed or of a type not in ``want``."""
        try:
            expr = Expr.parse(text)
            got = expr.infer_type(types)
        except ExprError as exc:
            self.add(path, f"{what}: {exc}", slot)
            return None
        if got not in want and not (got == "int" and "float" in want):
            self.add(path, f"{what} must be {' or '.join(want)}, but '{shorten(text, quote=False)}' is {got}", slot)
            return None
        return expr

    def no_live(self, path, text: str, params: Dict[str, ParamSpec], what: str, slot=None, *, refuse_runtime=False):
        """Report (and say whether) an expression names a live param (or with ``refuse_runtime`` a runtime
        one): expressions other than pad values are baked in, and only hooks may read live params."""
        try:
            names = sorted(Expr.parse(text).names & params.keys())
        except ExprError:
            return False  # the syntax is reported where the expression is checked
        kinds = ("live", "runtime") if refuse_runtime else ("live",)
        used = next(((kind, n) for kind in kinds for n in names if getattr(params[n], kind)), None)
        if used is not None:
            self.add(path, f"{what} uses {used[0]} param '{used[1]}': {NOT_BAKED[used[0]]}", slot)
        return used is not None


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
    """All cross-key problems of a spec's structurally valid parts (``import_hooks``: see :func:`.load_spec`);
    ``max_bytes`` (None: no cap) is checked only on a ``structurally_valid`` spec without other problems."""
    report = Reporter(file, locations)
    if isinstance(name, str) and not is_identifier(name):
        report.add(
            ("name",),
            f"spec name {shorten(name)} must be an identifier (letters, digits, '_'; "
            "not starting with a digit): generated module names are made from it",
        )
    for path, text in descriptions:
        report.control(path, text, "description", "\n\t", "; only newlines and tabs are allowed")
    types = {n: p.type for n, p in params.items()}
    baked = {n: t for n, t in types.items() if not (params[n].runtime or params[n].live)}
    check_params(params, types, report)
    check_presets(params, presets, report)
    bad = too_long_chain(params)
    if bad is not None:
        report.add(
            ("params", bad, "default"),
            f"param '{bad}': its default depends on a chain of more than {MAX_PARAM_CHAIN} param defaults; a "
            "default may name a param whose default names another, but not that deeply",
        )
    default_values = []  # param values under the defaults and under each preset, for evaluating extents
    if not report.issues:
        probe = RegistrySpec.model_construct(name="", params=params, presets=presets, slots=[])
        probe._source = file
        probe._locations = locations
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
        param_sets = list(zip([None, *presets], default_values))
        SlotChecker(slot, path, params, types, baked, param_sets, report, import_hooks).run()
    if structurally_valid and not report.issues and max_bytes is not None:
        _check_total_bytes(slots, presets, default_values, max_bytes, report)
    return report.issues


def _check_total_bytes(slots, presets, default_values, max_bytes: int, report: Reporter) -> None:
    """The bytes the enabled slots take at VALIDATION_CAPACITIES, under every param set."""
    where = ", ".join(f"{k}={v}" for k, v in VALIDATION_CAPACITIES.items())
    for preset, values in zip([None, *presets], default_values):
        env = dict(values, **VALIDATION_CAPACITIES)
        total = 0
        largest = (0, "")
        for index, slot in slots:
            try:
                if slot.enabled_if is not None and not evaluate_field(slot.enabled_if, values):
                    continue
                numel = math.prod(max(int(evaluate_field(extent, env)), 0) for extent in slot.shape)
            except ExprError as exc:
                report.add(("slots", index, "shape"), f"shape at {where}: {exc}", slot.name)
                return
            nbytes = numel * slot_dtype(slot, values).itemsize * (2 if slot.staged else 1)  # staged: host and device
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
            report.expr(path + ("default",), default, types, (param.type,), f"default of param '{name}'")
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
                report.control(path + ("default",), default, f"default of param '{name}'")
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
            report.no_live(path + ("default",), default, params, f"the default of param '{name}'")


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
                coerce_param(name, params[name].type, value, show=shorten)
            except ValueError as exc:
                report.add(path, f"preset '{shown}': {exc}")
                continue
            report.control(path, value, f"preset '{shown}': the value of param '{name}'")


class SlotChecker:
    """``types``: every param's; ``baked``: those a shape, dtype or enabled_if may use (not runtime, not live);
    ``param_sets``: ``(preset or None, values)`` under the defaults and each preset (none when params are broken)."""

    def __init__(self, slot: SlotSpec, path, params, types, baked, param_sets, report: Reporter, import_hooks):
        self.slot = slot
        self.path = path
        self.params = params
        self.report = report
        self.import_hooks = import_hooks
        self.shown_name = shorten(slot.name, quote=False)
        self.types = types
        self.baked = baked
        self.param_sets = param_sets

    def add(self, key: Optional[str], message: str) -> None:
        path = self.path if key is None else self.path + (key,)
        self.report.add(path, message, self.shown_name)

    def run(self) -> None:
        for check in (self.name, self.dtype, self.shape, self.padding, self.pad_value, self.enabled_if, self.hooks):
            check()

    def expr(self, key: str, text: str, types: Dict[str, str], want: Tuple[str, ...], what: str, allow_runtime=False):
        """The parsed expression, or None (reported): malformed, not ``want``, naming a live (or runtime) param."""
        path = self.path + (key,)
        if self.report.no_live(path, text, self.params, what, self.shown_name, refuse_runtime=not allow_runtime):
            return None
        return self.report.expr(path, text, types, want, what, self.slot.name)

    def name(self) -> None:
        slot = self.slot
        parts = slot.name.split(".")
        if not all(is_identifier(part) for part in parts):
            self.add("name", "slot names are identifiers, or dotted identifiers for structured slots")
        elif slot.name in RESERVED_SLOT_NAMES:
            self.add(
                "name", f"slot name '{slot.name}' is reserved: extract sets it on the view to the padded batch size"
            )
        elif any(part.startswith("__") for part in parts):
            self.add(
                "name",
                "slot names may not start with '__': extract sets the slot's attribute on the "
                "view, and '__class__' or '__dict__' would replace the view's type or storage "
                "(and generated code keeps '__' names for itself)",
            )
        if slot.is_structured and slot.source is None:
            self.add(
                "name", "a dotted (structured) slot needs a 'source' hook to read its value, e.g. source: dotted_field"
            )

    def dtype(self) -> None:
        dtype = self.slot.dtype
        if dtype in self.params:
            if self.params[dtype].type != "dtype":
                self.add("dtype", f"param '{dtype}' is {self.params[dtype].type}, not a dtype")
        elif parse_dtype(dtype) is None:
            dtype_params = [n for n, p in self.params.items() if p.type == "dtype"]
            self.add(
                "dtype",
                f"unknown dtype '{shorten(dtype, quote=False)}': use a torch dtype name (int64, int32, bool, "
                f"float32, bfloat16, …) or a dtype param" + dtype_hint(dtype, dtype_params),
            )

    def shape(self) -> None:
        slot = self.slot
        types = dict(self.baked, **dict.fromkeys(CAPACITY_NAMES, "int"))
        if len(slot.shape) > MAX_RANK:
            self.add("shape", f"shape has {len(slot.shape)} dimensions; at most {MAX_RANK} are allowed")
            return
        for d, extent in enumerate(slot.shape):
            if isinstance(extent, str):
                expr = self.expr("shape", extent, types, ("int",), f"shape[{d}]")
                if expr is None or expr.names & set(CAPACITY_NAMES):
                    continue
                for _, values in self.param_sets:
                    try:
                        n = expr.evaluate(values)
                    except ExprError as exc:
                        self.add("shape", f"shape[{d}]: {exc}")
                        break
                    if n < 1:
                        self.add("shape", f"shape[{d}] = '{extent}' evaluates to {n}; extents must be positive")
                        break
            elif extent < 1:
                self.add("shape", f"shape[{d}] is {extent}; extents must be positive")
        if not slot.shape:  # 0-d: a scalar buffer, the view is the buffer
            if Axis(slot.axis).sliced:
                self.add(
                    "shape", f"a 0-d slot (shape: []) has no dimension to slice: use axis 'none', not '{slot.axis}'"
                )
            elif slot.slice_dim != 0:
                self.add("slice_dim", "a 0-d slot (shape: []) has no dimension to slice; remove slice_dim")
        elif not 0 <= slot.slice_dim < len(slot.shape):
            self.add(
                "slice_dim",
                f"slice_dim {slot.slice_dim} is beyond the shape {list(slot.shape)} "
                f"(it has {len(slot.shape)} dimension(s))",
            )
        elif Axis(slot.axis).sliced:
            capacity = Axis(slot.axis).capacity
            k = max(slot.extra_rows, 0)
            extent = slot.shape[slot.slice_dim]
            spelt = "".join(extent.split()) if isinstance(extent, str) else None
            if k and spelt not in (f"{capacity}+{k}", f"{k}+{capacity}"):
                self.add(
                    "shape",
                    f"axis '{slot.axis}' slices dimension {slot.slice_dim} and extra_rows is {k}, so that extent "
                    f"must be '{capacity} + {k}' (the capacity plus extra_rows), got {shorten(extent)}",
                )
            elif not k and not (isinstance(extent, str) and extent.strip() == capacity):
                self.add(
                    "shape",
                    f"axis '{slot.axis}' slices dimension {slot.slice_dim}, so that extent "
                    f"must be '{capacity}' (the buffer's capacity), got {shorten(extent)}",
                )

    def padding(self) -> None:
        """padding, pad_value, index, extra_rows, reset_to and staged together, under every param set."""
        for key, message in tail_issues(self.slot, self.params, self.param_sets):
            self.add(key, message)

    def pad_value(self) -> None:
        """That the pad value fits the dtype, under every param set, where a policy may use it."""
        slot = self.slot
        literal = slot.padding is None or slot.padding in CHOICES["padding"]
        if slot.pad_value is None or (literal and not Padding.of(slot.padding).needs_pad_value):
            return
        if not literal and choice_param(slot, "padding", self.params) is None:
            return  # padding names no valid param: reported by the padding check
        if isinstance(slot.pad_value, str):
            want = ("int", "float", "bool")
            if self.expr("pad_value", slot.pad_value, self.types, want, "pad_value", allow_runtime=True) is None:
                return
        for _, values in self.param_sets:
            dtype = slot_dtype(slot, values)
            if dtype is None:
                return
            try:
                value = evaluate_field(slot.pad_value, values)
            except ExprError as exc:
                self.add("pad_value", f"pad_value: {exc}")
                return
            if not value_fits_dtype(value, dtype):
                self.add(
                    "pad_value", f"pad_value {shorten(value)} ({python_type_name(value)}) does not fit dtype {dtype}"
                )
                return

    def enabled_if(self) -> None:
        cond = self.slot.enabled_if
        if isinstance(cond, str):
            self.expr("enabled_if", cond, self.baked, ("bool",), "enabled_if")

    def hooks(self) -> None:
        slot = self.slot
        for kind in HOOK_SIGNATURES:
            ref = getattr(slot, kind)
            if ref is None:
                continue
            if is_import_reference(ref):
                if not IMPORT_REFERENCE.fullmatch(ref):
                    self.add(
                        kind,
                        f"malformed hook reference {shorten(ref)}: write 'package.module:function' "
                        "(a dotted module path of identifiers, ':', a function name)",
                    )
                    continue
                if not self.import_hooks:
                    continue  # the CLI says it was not checked; build_registry imports it
            elif not DOTTED.fullmatch(ref):
                self.add(
                    kind,
                    f"hook name {shorten(ref)} is not an identifier (dots allowed): name a built-in "
                    "hook or a build_registry(hooks=...) key, or write 'package.module:function'",
                )
                continue
            try:
                check_reference(ref, kind)
            except HookError as exc:
                self.add(kind, str(exc))
            except (Exception, SystemExit) as exc:  # user code ran: anything can come out of it
                self.add(
                    kind, f"importing hook '{ref}' failed: {type(exc).__name__}: {shorten(str(exc), 200, quote=False)}"
                )
        if slot.source is not None and not slot.copy_from_fb:
            self.add("source", "a source hook only feeds the copy, and copy_from_fb is false; remove one")
