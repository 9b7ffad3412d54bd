"""The checks of one slot (name, dtype, shape, padding, pad value, enabled_if, hooks), and the
reporter and expression checks every check uses: each appends a :class:`SpecIssue` instead of
raising, so one run reports every problem in a file."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .dtypes import dtype_hint, parse_dtype, value_fits_dtype
from .errors import ExprError, SpecIssue, shorten
from .expr import Expr, python_type_name
from .hooks import HOOK_SIGNATURES, HookError, check_reference, is_import_reference
from .kinds import CAPACITY_NAMES, Axis, Padding
from .model import ParamSpec, SlotSpec
from .names import DOTTED, IMPORT_REFERENCE, is_identifier
from .resolve import evaluate_field, slot_dtype
from .yaml_loader import Locations

# Most dimensions a slot's shape may have.
MAX_RANK = 16
# Attributes extract sets besides the slots' own.
RESERVED_SLOT_NAMES = ("batch_size",)


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
    text: str, params: Dict[str, ParamSpec], path, report: Reporter, what: str, slot=None, runtime=False
) -> bool:
    """Report (and say whether) an expression names a live param (or with ``runtime`` a runtime
    one): expressions other than pad values are baked in, and only hooks may read live params."""
    try:
        names = sorted(Expr.parse(text).names & params.keys())
    except ExprError:
        return False  # the syntax is reported where the expression is checked
    live = [n for n in names if params[n].live]
    runtime_used = [n for n in names if runtime and params[n].runtime]
    if live:
        report.add(
            path,
            f"{what} uses live param '{live[0]}': live params are evaluated at fill time by the "
            "hooks that read them (ctx.params), so shapes, dtypes, enabled_if, pad values and "
            "other params' defaults cannot use them",
            slot,
        )
    elif runtime_used:
        report.add(
            path,
            f"{what} uses runtime param '{runtime_used[0]}': runtime params are passed at fill time, "
            "so only pad values may use them",
            slot,
        )
    return bool(live or runtime_used)


class SlotChecker:
    def __init__(self, slot: SlotSpec, path, params, types, default_values, report: Reporter, import_hooks=False):
        self.slot, self.path, self.params, self.report, self.import_hooks = slot, path, params, report, import_hooks
        self.shown_name = shorten(slot.name, quote=False)
        self.types, self.default_values = types, default_values
        self.runtime = {n for n, p in params.items() if p.runtime}
        self.live = {n for n, p in params.items() if p.live}

    def add(self, key: Optional[str], message: str) -> None:
        path = self.path if key is None else self.path + (key,)
        self.report.add(path, message, self.shown_name)

    def run(self) -> None:
        for check in (self.name, self.dtype, self.shape, self.padding, self.pad_value, self.enabled_if, self.hooks):
            check()

    def expr(self, key: str, text: str, types: Dict[str, str], want: Tuple[str, ...], what: str):
        return check_expr(text, types, want, self.path + (key,), self.report, what, self.slot.name)

    def no_live(self, key: str, text: str, what: str, runtime: bool = True) -> bool:
        """Report (and say whether) an expression names a param that is not baked in (pad values may use runtime ones)."""
        return check_no_live(text, self.params, self.path + (key,), self.report, what, self.shown_name, runtime)

    def structural_types(self) -> Dict[str, str]:
        """Names a shape, dtype or enabled_if may use: runtime and live params are not baked."""
        return {k: v for k, v in self.types.items() if k not in self.runtime and k not in self.live}

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
        types = dict(self.structural_types(), **{n: "int" for n in CAPACITY_NAMES})
        if len(slot.shape) > MAX_RANK:
            self.add("shape", f"shape has {len(slot.shape)} dimensions; at most {MAX_RANK} are allowed")
            return
        for d, extent in enumerate(slot.shape):
            if isinstance(extent, str):
                if self.no_live("shape", extent, f"shape[{d}]"):
                    continue
                expr = self.expr("shape", extent, types, ("int",), f"shape[{d}]")
                if expr is None or expr.names & set(CAPACITY_NAMES):
                    continue
                for values in self.default_values:
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
            extent = slot.shape[slot.slice_dim]
            if not (isinstance(extent, str) and extent.strip() == capacity):
                self.add(
                    "shape",
                    f"axis '{slot.axis}' slices dimension {slot.slice_dim}, so that extent "
                    f"must be '{capacity}' (the buffer's capacity), got {shorten(extent)}",
                )

    def padding(self) -> None:
        slot, padding = self.slot, Padding.of(self.slot.padding)
        if not Axis(slot.axis).sliced:
            if padding.resets_tail:
                self.add(
                    "padding",
                    f"axis 'none' is never sliced, so padding '{slot.padding}' would never "
                    "reset anything; use keep_pad, or fill_once to initialise the buffer",
                )
        elif slot.padding is None:
            self.add(
                None,
                f"missing 'padding': a '{slot.axis}'-axis slot must say how its padded tail is "
                f"made safe (one of {', '.join(Padding.values())})",
            )
        if slot.index and padding is not Padding.ZERO:
            self.add(
                "index",
                f"index slots must use padding 'zero' (got '{padding}'): "
                "a stale or sentinel tail would index out of the pool",
            )

    def pad_value(self) -> None:
        slot, padding = self.slot, Padding.of(self.slot.padding)
        needs = padding.needs_pad_value
        if needs and slot.pad_value is None:
            self.add(None, f"padding '{slot.padding}' needs a 'pad_value'")
        elif not needs and slot.pad_value is not None:
            self.add(
                "pad_value",
                f"pad_value is only used by fill_sentinel and fill_once, not "
                f"'{padding}'; remove it or change the padding",
            )
        if slot.pad_value is None or not needs:
            return
        if isinstance(slot.pad_value, str):
            if self.no_live("pad_value", slot.pad_value, "pad_value", runtime=False):
                return
            if self.expr("pad_value", slot.pad_value, self.types, ("int", "float", "bool"), "pad_value") is None:
                return
        for values in self.default_values:
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
        if isinstance(cond, str) and not self.no_live("enabled_if", cond, "enabled_if"):
            self.expr("enabled_if", cond, self.structural_types(), ("bool",), "enabled_if")

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
