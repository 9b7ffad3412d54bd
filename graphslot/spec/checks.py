"""The rules that relate a spec's keys to each other.

Each check appends :class:`SpecIssue` s instead of raising, so one run reports every
problem in a file. Checks run on the parts of a spec that passed structural (pydantic)
validation; a slot with a structural error is not checked twice.
"""

from __future__ import annotations

import keyword
import re
import unicodedata
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .dtypes import DTYPES, parse_dtype, value_fits_dtype
from .errors import ExprError, SpecError, SpecIssue, did_you_mean, shorten
from .expr import Expr, python_type_name
from .hooks import HOOK_SIGNATURES, HookError, check_reference, is_import_reference
from .model import PADDINGS, ParamSpec, RegistrySpec, SlotSpec
from .resolve import AXIS_CAPACITY, CAPACITY_NAMES, coerce_param, evaluate_field, resolve_params, slot_dtype
from .yaml_loader import Locations

# Names are ASCII identifiers, matched in full (``$`` would let a trailing newline from a
# YAML block scalar through).
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_IMPORT_REF = re.compile(_DOTTED + ":" + _DOTTED)
_PLAIN_HOOK = re.compile(_DOTTED)
# Attributes extract sets besides the slots' own.
RESERVED_SLOT_NAMES = ("batch_size",)
# Unicode bidirectional controls: they make text read differently from what it is.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")

# The cap on the bytes a spec may declare, summed over its enabled slots at
# VALIDATION_CAPACITIES, under the defaults and under each preset. Override per call
# (parse_spec/load_spec(max_bytes=N), `graphslot validate --max-bytes N`).
DEFAULT_MAX_BYTES = 4 << 30
VALIDATION_CAPACITIES = {"max_bs": 256, "max_num_tokens": 256}
# Most dimensions a slot's shape may have.
MAX_RANK = 16
# Longest chain of param defaults naming each other (a -> b -> c is 3).
MAX_PARAM_CHAIN = 64


def control_character(text: str, allow: str = "") -> Optional[str]:
    """The first control (or bidi) character of ``text`` not in ``allow``, else None."""
    if text.isprintable():
        return None
    for c in text:
        if c not in allow and (unicodedata.category(c) in ("Cc", "Cs") or c in _BIDI or c in "\u2028\u2029"):
            return c
    return None


def _char_name(c: str) -> str:
    return f"U+{ord(c):04X}"


def is_identifier(name: Any) -> bool:
    return isinstance(name, str) and _IDENT.fullmatch(name) is not None
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
    *,
    name: Any = None,
    descriptions: Sequence[Tuple[Tuple[Any, ...], Any]] = (),
    import_hooks: bool = False,
    max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
    structurally_valid: bool = False,
) -> List[SpecIssue]:
    """All cross-key problems of a spec whose structurally valid parts are given.

    ``import_hooks``: import ``module:function`` hooks and check their signatures; off,
    only the form of the reference is checked and no user code runs. ``max_bytes``: the
    cap on the bytes the spec declares at VALIDATION_CAPACITIES (None: no cap); checked
    only on a ``structurally_valid`` spec without other problems.
    """
    report = _Reporter(file, locations)
    _check_texts(name, descriptions, report)
    types = {n: p.type for n, p in params.items()}
    _check_params(params, types, report)
    _check_presets(params, presets, report)
    chains_ok = _check_param_chains(params, report)
    default_values = _default_values(params, presets, file, locations, report) if chains_ok else []
    first_line: Dict[str, int] = {}
    for index, slot in slots:
        path = ("slots", index)
        if slot.name in first_line:
            report.add(path + ("name",), f"duplicate slot name (first at line {first_line[slot.name]})",
                       shorten(slot.name, quote=False))
        else:
            first_line[slot.name] = locations.line(path + ("name",)) or 0
        _SlotChecker(slot, path, params, types, default_values, report, import_hooks).run()
    if structurally_valid and not report.issues and max_bytes is not None:
        _check_total_bytes(slots, presets, default_values, max_bytes, report)
    return report.issues


def _check_texts(name: Any, descriptions, report: _Reporter) -> None:
    if isinstance(name, str) and not is_identifier(name):
        report.add(("name",), f"spec name {shorten(name)} must be an identifier (letters, digits, '_'; "
                              "not starting with a digit): generated module names are made from it")
    for path, text in descriptions:
        bad = control_character(text, allow="\n\t")
        if bad is not None:
            slot = None
            report.add(path, f"description contains the control character {_char_name(bad)}; "
                             "only newlines and tabs are allowed", slot)


def _check_param_chains(params: Dict[str, ParamSpec], report: _Reporter) -> bool:
    """Report default chains longer than MAX_PARAM_CHAIN (resolving them recurses)."""
    deps: Dict[str, List[str]] = {}
    for name, param in params.items():
        names: List[str] = []
        if isinstance(param.default, str) and param.type in ("int", "float", "bool"):
            try:
                names = sorted(Expr.parse(param.default).names & params.keys())
            except ExprError:
                pass
        deps[name] = names
    depth: Dict[str, int] = {}
    for start in params:
        if start in depth:
            continue
        stack, on_stack = [(start, iter(deps[start]))], {start}
        while stack:
            node, children = stack[-1]
            if len(stack) > MAX_PARAM_CHAIN:
                report.add(("params", start, "default"),
                           f"param '{start}': its default depends on a chain of more than {MAX_PARAM_CHAIN} "
                           "param defaults; a default may name a param whose default names another, but "
                           "not that deeply")
                return False
            child = next(children, None)
            if child is None:
                stack.pop()
                on_stack.discard(node)
                depth[node] = 1 + max((depth.get(c, 0) for c in deps[node]), default=0)
                if depth[node] > MAX_PARAM_CHAIN:
                    report.add(("params", node, "default"),
                               f"param '{node}': its default depends on a chain of more than {MAX_PARAM_CHAIN} "
                               "param defaults; a default may name a param whose default names another, but "
                               "not that deeply")
                    return False
            elif child not in on_stack and child not in depth:  # a cycle is reported by resolve_params
                stack.append((child, iter(deps[child])))
                on_stack.add(child)
    return True


def _check_params(params: Dict[str, ParamSpec], types: Dict[str, str], report: _Reporter) -> None:
    for name, param in params.items():
        path = ("params", name)
        if not isinstance(name, str):
            continue  # YAML read the key as a bool or number: reported by the structural check
        if not is_identifier(name) or keyword.iskeyword(name) or name in CAPACITY_NAMES + ("true", "false"):
            report.add(path, f"param name {shorten(name)} must be an identifier other than "
                             f"{', '.join(CAPACITY_NAMES)}, true and false")
            continue
        if name.startswith("__"):
            report.add(path, f"param name {shorten(name)} may not start with '__': generated code keeps "
                             "'__' names for itself")
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
                                                f"got {shorten(default)}" + _dtype_hint(param.type, default))
            else:
                bad = control_character(default) if isinstance(default, str) else None
                if bad is not None:
                    report.add(path + ("default",), f"default of param '{name}' contains the control "
                                                    f"character {_char_name(bad)}")
        if param.runtime and param.type not in ("int", "float", "bool"):
            report.add(path + ("runtime",), f"runtime param '{name}' must be int, float or bool")
        if param.live and param.runtime:
            report.add(path + ("live",), f"param '{name}' cannot be both runtime and live: a runtime param is "
                                         "bound with the registry, a live one read by hooks at each fill")
        elif param.live and param.type == "dtype":
            report.add(path + ("live",), f"live param '{name}' must be int, float, bool or str: a dtype decides "
                                         "what is allocated, and live params are read only by hooks")
        if not param.live and isinstance(default, str) and param.type in ("int", "float", "bool"):
            _check_no_live(default, params, path + ("default",), report, f"the default of param '{name}'")


def _check_presets(params: Dict[str, ParamSpec], presets: Dict[str, Dict[str, Any]], report: _Reporter) -> None:
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
                report.add(path, f"preset '{shown}': the value of param '{name}' contains the control "
                                 f"character {_char_name(bad)}")


def _check_no_live(text: str, params: Dict[str, ParamSpec], path, report, what: str,
                   slot: Optional[str] = None) -> bool:
    """Report (and say whether) an expression names a live param: live params are
    evaluated at fill time, and only hooks may read them."""
    try:
        used = sorted(n for n in Expr.parse(text).names if n in params and params[n].live)
    except ExprError:
        return False  # the syntax is reported where the expression is checked
    if used:
        report.add(path, f"{what} uses live param '{used[0]}': live params are evaluated at fill time by the "
                         "hooks that read them (ctx.params), so shapes, dtypes, enabled_if, pad values and "
                         "other params' defaults cannot use them", slot)
    return bool(used)


def _default_values(params, presets, file, locations, report) -> List[Dict[str, Any]]:
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
        report.add(path, f"{what} must be {' or '.join(want)}, but '{shorten(text, quote=False)}' is {got}", slot)
        return None
    return expr


def _check_total_bytes(slots, presets, default_values, max_bytes: int, report: _Reporter) -> None:
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
            report.add(("slots",), f"the enabled slots take {total} bytes at {where}{under}, more than the "
                                   f"limit of {max_bytes} bytes (largest: slot '{largest[1]}', {largest[0]} "
                                   "bytes); raise it with `graphslot validate --max-bytes N` or "
                                   "load_spec(..., max_bytes=N)")
            return


class _SlotChecker:
    def __init__(self, slot: SlotSpec, path, params, types, default_values, report: _Reporter,
                 import_hooks: bool = False):
        self.slot, self.path, self.params, self.report = slot, path, params, report
        self.import_hooks = import_hooks
        self.shown_name = shorten(slot.name, quote=False)
        self.types, self.default_values = types, default_values
        self.runtime = {n for n, p in params.items() if p.runtime}
        self.live = {n for n, p in params.items() if p.live}

    def add(self, key: Optional[str], message: str) -> None:
        path = self.path if key is None else self.path + (key,)
        self.report.add(path, message, self.shown_name)

    def run(self) -> None:
        for check in (self.name, self.dtype, self.shape, self.padding, self.pad_value,
                      self.enabled_if, self.hooks):
            check()

    def structural_types(self) -> Dict[str, str]:
        """Names a shape, dtype or enabled_if may use: runtime and live params are not baked."""
        return {k: v for k, v in self.types.items() if k not in self.runtime and k not in self.live}

    def name(self) -> None:
        slot = self.slot
        parts = slot.name.split(".")
        if not all(is_identifier(part) for part in parts):
            self.add("name", "slot names are identifiers, or dotted identifiers for structured slots")
        elif slot.name in RESERVED_SLOT_NAMES:
            self.add("name", f"slot name '{slot.name}' is reserved: extract sets it on the view to the padded "
                             "batch size")
        elif any(part.startswith("__") for part in parts):
            self.add("name", "slot names may not start with '__': extract sets the slot's attribute on the "
                             "view, and '__class__' or '__dict__' would replace the view's type or storage "
                             "(and generated code keeps '__' names for itself)")
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
            self.add("dtype", f"unknown dtype '{shorten(dtype, quote=False)}': use a torch dtype name (int64, int32, bool, "
                              f"float32, bfloat16, …) or a dtype param" + did_you_mean(dtype, list(DTYPES) + dtype_params))

    def uses_runtime(self, text: str, key: str, what: str) -> bool:
        """Report (and say whether) an expression that must be baked names a runtime or
        a live param."""
        if _check_no_live(text, self.params, self.path + (key,), self.report, what, self.shown_name):
            return True
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
        if len(slot.shape) > MAX_RANK:
            self.add("shape", f"shape has {len(slot.shape)} dimensions; at most {MAX_RANK} are allowed")
            return
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
            if slot.axis != "none":
                self.add("shape", f"a 0-d slot (shape: []) has no dimension to slice: use axis 'none', not "
                                  f"'{slot.axis}'")
            elif slot.slice_dim != 0:
                self.add("slice_dim", "a 0-d slot (shape: []) has no dimension to slice; remove slice_dim")
        elif not 0 <= slot.slice_dim < len(slot.shape):
            self.add("slice_dim", f"slice_dim {slot.slice_dim} is beyond the shape {list(slot.shape)} "
                                  f"(it has {len(slot.shape)} dimension(s))")
        elif slot.axis in AXIS_CAPACITY:
            capacity = AXIS_CAPACITY[slot.axis]
            extent = slot.shape[slot.slice_dim]
            if not (isinstance(extent, str) and extent.strip() == capacity):
                self.add("shape", f"axis '{slot.axis}' slices dimension {slot.slice_dim}, so that extent "
                                  f"must be '{capacity}' (the buffer's capacity), got {shorten(extent)}")

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
            if _check_no_live(slot.pad_value, self.params, self.path + ("pad_value",), self.report, "pad_value",
                              self.shown_name):
                return
            if _check_expr(slot.pad_value, self.types, ("int", "float", "bool"), self.path + ("pad_value",),
                           self.report, "pad_value", slot.name) is None:
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
                self.add("pad_value", f"pad_value {shorten(value)} ({python_type_name(value)}) does not fit dtype "
                                      f"{dtype}")
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
            if is_import_reference(ref):
                if not _IMPORT_REF.fullmatch(ref):
                    self.add(kind, f"malformed hook reference {shorten(ref)}: write 'package.module:function' "
                                   "(a dotted module path of identifiers, ':', a function name)")
                    continue
                if not self.import_hooks:
                    continue  # the CLI says it was not checked; build_registry imports it
            elif not _PLAIN_HOOK.fullmatch(ref):
                self.add(kind, f"hook name {shorten(ref)} is not an identifier (dots allowed): name a built-in "
                               "hook or a build_registry(hooks=...) key, or write 'package.module:function'")
                continue
            try:
                check_reference(ref, kind)
            except HookError as exc:
                self.add(kind, str(exc))
            except (Exception, SystemExit) as exc:  # user code ran: anything can come out of it
                self.add(kind, f"importing hook '{ref}' failed: {type(exc).__name__}: "
                               f"{shorten(str(exc), 200, quote=False)}")
        if slot.source is not None and not slot.copy_from_fb:
            self.add("source", "a source hook only feeds the copy, and copy_from_fb is false; remove one")
