"""From a validated spec and a param set to concrete slots: ``resolve_params`` then ``resolve_slots``.
The interpreter and the code generator both start from the result, so they cannot disagree on a spec."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .dtypes import DTypeName, parse_dtype, spelling_hint, torch_dtype, value_fits_dtype
from .errors import ExprError, SpecError, SpecIssue, did_you_mean, shorten
from .expr import Expr, evaluate_field
from .live import Live
from .kinds import CAPACITY_NAMES, Axis, Padding, ResetTo, SlotKind
from .model import RegistrySpec, SlotSpec, one_nan
from .policy import ChoiceError, Problem, chosen, choice_param, tail_of, tail_problems


@dataclass(frozen=True)
class ResolvedSlot(SlotKind):
    """One slot with every expression evaluated for a param set and capacities; the dtype
    kept as its name (no torch needed), ``dtype`` the ``torch.dtype`` made on first use."""

    name: str
    shape: Tuple[int, ...]
    dtype_name: DTypeName
    axis: Axis
    slice_dim: int
    host: bool  # ``device: cpu``: a host buffer whatever the registry's device
    padding: Padding  # the declared policy (or its param's value), or keep_pad
    pad_value: Any
    index: Any  # False, True or "skip"
    optional: bool
    enabled: bool
    copy_from_fb: bool
    post_fill: Optional[str]
    source: Optional[str]
    pre_capture: Optional[str]
    line: Optional[int]
    #: Copied as rows: a ``[L, capacity]`` device slot sliced along dim 1 (``L`` fixed by params) is
    #: copied as L 1-D row slices in both modes (``copy_`` judges overlapping sources per row, alike),
    #: so the rows can join the device's grouped copy.
    rows: bool = False
    #: False for ``adopt: never``: allocated (or pooled) even when ``adopt=`` is given.
    adopt: bool = True
    #: ``absent_fields: skip`` on a copied slot: a field missing, None or not a tensor is no copy.
    skip_absent: bool = False
    #: Rows of the head beyond the step's count: a step's head is ``[:raw + extra_rows]``.
    extra_rows: int = 0
    #: How far a tail-writing policy writes (its param's value, for a reset_to naming one).
    reset_to: ResetTo = ResetTo.PADDED
    #: A host buffer the fill writes and a device buffer the graph reads, copied host to device per fill.
    staged: bool = False

    @property
    def dtype(self) -> Any:
        return torch_dtype(self.dtype_name)

    @property
    def fills_host(self) -> bool:
        """The buffer a fill writes is on the host: a ``device: cpu`` slot's, or a staged slot's host buffer."""
        return self.host or self.staged

    @property
    def repeats_last(self) -> bool:
        """Step 5 of the fill: the tail takes the head's last row."""
        return self.axis.sliced and self.padding is Padding.REPEAT_LAST

    @property
    def to_capacity(self) -> bool:
        """The tail a policy writes runs to the end of the buffer, not to the padded size."""
        return self.reset_to is ResetTo.CAPACITY

    @property
    def plain_copy(self) -> bool:
        """Copied straight from the same-named batch field (the None-carry rule)."""
        return self.copy_from_fb and self.source is None and self.post_fill is None

    @property
    def resets_tail(self) -> bool:
        return self.axis.sliced and self.padding.resets_tail

    @property
    def tail_value(self) -> Any:
        return 0 if self.padding is Padding.ZERO else self.pad_value

    @property
    def fills_at_allocation(self) -> bool:
        return self.padding.needs_pad_value

    @property
    def nbytes(self) -> int:
        """The bytes its buffers take (computed, as a Python int: never overflows); a staged slot has two."""
        return math.prod(self.shape) * self.dtype_name.itemsize * (2 if self.staged else 1)


# The Python values each param type takes (a bool is not an int here).
PYTHON_TYPES = {"bool": bool, "int": int, "float": (int, float), "str": str}


def coerce_param(name: str, ptype: str, value: Any, got: str = "got", show: Callable = repr) -> Any:
    """``value`` as a ``ptype`` param (a dtype as its :class:`DTypeName`), else ValueError saying what was expected.
    Also checks a live param's value from its provider (``got="its provider returned"``) as one given at build."""
    if ptype == "dtype":
        dtype = parse_dtype(value)
        if dtype is None:
            raise ValueError(
                f"param '{name}' is a dtype: pass torch.int64 or 'int64', {got} {show(value)}" + spelling_hint(value)
            )
        return dtype
    if not isinstance(value, PYTHON_TYPES[ptype]) or (isinstance(value, bool) and ptype != "bool"):
        raise ValueError(f"param '{name}' is {ptype}, {got} {type(value).__name__} {show(value)}")
    return one_nan(float(value)) if ptype == "float" else value


def resolve_params(
    spec: RegistrySpec,
    overrides: Optional[Mapping[str, Any]] = None,
    preset: Optional[str] = None,
    *,
    torch_dtypes: bool = True,
) -> Dict[str, Any]:
    """Every param's value: explicit override, else preset, else (evaluated) default. Dtype
    params come back as ``torch.dtype``, or with ``torch_dtypes=False`` as names (no torch)."""
    file = spec.path
    issues = []
    if preset is not None and preset not in spec.presets:
        known = ", ".join(sorted(spec.presets)) or "none"
        raise SpecError.at(
            file, None, f"unknown preset '{preset}' (presets: {known})" + did_you_mean(preset, spec.presets)
        )
    explicit = {**(spec.presets[preset] if preset is not None else {}), **(overrides or {})}

    values: Dict[str, Any] = {}
    for name, value in explicit.items():
        if name not in spec.params:
            issues.append(SpecIssue(file, None, f"unknown param '{name}'" + did_you_mean(name, spec.params)))
            continue
        ptype = spec.params[name].type
        if spec.params[name].live and (isinstance(value, Live) or callable(value)):
            fn = value.fn if isinstance(value, Live) else value  # evaluated by the hooks at fill, then checked
            values[name] = Live(
                fn, functools.partial(coerce_param, name, ptype, got="its provider returned", show=shorten)
            )
            continue
        try:
            values[name] = coerce_param(name, ptype, value)
        except ValueError as exc:
            hint = "; a provider (a callable read at fill time) is only taken by a `live: true` param"
            hint = hint if callable(value) and not isinstance(value, type) else ""
            issues.append(SpecIssue(file, spec.param_line(name), str(exc) + hint))
    if issues:
        raise SpecError(issues)

    def evaluate(name: str, stack: Tuple[str, ...]) -> Any:
        if name in values:
            return values[name]
        if name in stack:
            cycle = " -> ".join(stack[stack.index(name) :] + (name,))
            raise SpecError.at(file, spec.param_line(name), f"param defaults form a cycle: {cycle}")
        param = spec.params[name]
        if isinstance(param.default, str) and param.type in ("int", "float", "bool"):
            expr = Expr.parse(param.default)
            env = {dep: evaluate(dep, stack + (name,)) for dep in expr.names if dep in spec.params}
            try:
                value = expr.evaluate(env)
            except ExprError as exc:
                raise SpecError.at(file, spec.param_line(name), f"param '{name}': {exc}") from None
        else:
            value = param.default
        values[name] = coerce_param(name, param.type, value)
        return values[name]

    for name in spec.params:
        evaluate(name, ())
    return {
        n: torch_dtype(values[n]) if torch_dtypes and isinstance(values[n], DTypeName) else values[n]
        for n in spec.params
    }


# Longest chain of param defaults naming each other (a -> b -> c is 3): resolve_params recurses along it.
MAX_PARAM_CHAIN = 64


def too_long_chain(params: Mapping[str, Any]) -> Optional[str]:
    """The param to report for a chain of defaults longer than MAX_PARAM_CHAIN, else None (a cycle is
    reported by resolve_params); at most MAX_PARAM_CHAIN + 1 calls deep."""
    deps: Dict[str, List[str]] = {name: [] for name in params}
    for name, param in params.items():
        if isinstance(param.default, str) and param.type in ("int", "float", "bool"):
            with contextlib.suppress(ExprError):  # a malformed default is reported where it is checked
                deps[name] = sorted(Expr.parse(param.default).names & params.keys())
    depth: Dict[str, int] = {}

    def too_long(name: str, path: Tuple[str, ...]) -> Optional[str]:
        if len(path) > MAX_PARAM_CHAIN:
            return path[0]
        for child in deps[name]:
            found = None if child in path or child in depth else too_long(child, path + (child,))
            if found is not None:
                return found
        depth[name] = 1 + max((depth.get(c, 0) for c in deps[name]), default=0)
        return name if depth[name] > MAX_PARAM_CHAIN else None

    found = (too_long(start, (start,)) for start in params if start not in depth)  # lazy: sees depth grow
    return next((bad for bad in found if bad is not None), None)


def slot_dtype(slot: SlotSpec, params: Mapping[str, Any]) -> Optional[DTypeName]:
    """A slot's dtype name: its dtype param's value (a name or a torch dtype), or the name it spells."""
    return parse_dtype(params[slot.dtype] if slot.dtype in params else slot.dtype)


def depends_on_capacity(extent: Any) -> bool:
    """Whether a declared extent is an expression of ``max_bs`` or ``max_num_tokens``."""
    return isinstance(extent, str) and not Expr.parse(extent).names.isdisjoint(CAPACITY_NAMES)


def copied_as_rows(slot: SlotSpec) -> bool:
    """See :attr:`ResolvedSlot.rows`."""
    sliced_rows = Axis(slot.axis).sliced and slot.slice_dim == 1 and len(slot.shape) == 2
    return sliced_rows and slot.device != "cpu" and not depends_on_capacity(slot.shape[0])


def resolve_slot(
    slot: SlotSpec,
    params: Mapping[str, Any],
    max_bs: int,
    max_num_tokens: int,
    line: Optional[int] = None,
    absent_fields: str = "error",
) -> ResolvedSlot:
    """``absent_fields``: the spec's rule; ``skip`` makes every slot copied from its
    batch field optional, and a field that is not a tensor no copy either. A padding or reset_to naming a
    param whose value is not a choice is a ValueError saying so."""
    env = dict(params, max_bs=max_bs, max_num_tokens=max_num_tokens)
    skip_absent = absent_fields == "skip" and slot.copy_from_fb and slot.source is None
    enabled = True if slot.enabled_if is None else bool(evaluate_field(slot.enabled_if, params))
    pad_value = None if slot.pad_value is None else evaluate_field(slot.pad_value, params)
    same = {
        k: getattr(slot, k)
        for k in ("name", "slice_dim", "index", "copy_from_fb", "post_fill", "source", "pre_capture")
    }
    return ResolvedSlot(
        **same,
        shape=tuple(int(evaluate_field(extent, env)) for extent in slot.shape),
        dtype_name=slot_dtype(slot, params),
        axis=Axis(slot.axis),
        host=slot.device == "cpu",
        padding=Padding.of(chosen(slot, "padding", params)),
        reset_to=ResetTo(chosen(slot, "reset_to", params)),
        pad_value=pad_value,
        optional=slot.optional or skip_absent,
        enabled=enabled,
        rows=copied_as_rows(slot),
        line=line,
        adopt=slot.adopt != "never",
        skip_absent=skip_absent,
        extra_rows=slot.extra_rows,
        staged=slot.staged,
    )


def tail_problems_of(slot: SlotSpec, resolved: ResolvedSlot, params: Mapping[str, Any]) -> List[Problem]:
    """The tail rules (:func:`.policy.tail_problems`) a resolved slot breaks with these params: a ``str`` param's
    value given at build, or a runtime pad value, that validation did not see."""
    padding = chosen(slot, "padding", params)
    named = choice_param(slot, "padding", params) is not None
    return tail_problems(tail_of(slot, padding, resolved.reset_to, resolved.pad_value, named))


# Resolved slots kept per (spec object, params that can shape them, capacities): a registry
# built again resolves nothing twice. Live params are left out of the key (no slot may use
# one), so a new provider per build still hits.
RESOLVED_CACHE_LIMIT = 256
_RESOLVED: Dict[tuple, Tuple[RegistrySpec, Tuple[ResolvedSlot, ...]]] = {}


def resolve_slots(
    spec: RegistrySpec, params: Mapping[str, Any], max_bs: int, max_num_tokens: int
) -> List[ResolvedSlot]:
    """Concrete slots; extents that come out non-positive are errors naming the slot."""
    for name, value in zip(CAPACITY_NAMES, (max_bs, max_num_tokens)):
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # ints, numpy ints
            raise ValueError(f"{name} must be an int, got {type(value).__name__} {shorten(value)}")
    if max_bs < 1 or max_num_tokens < 1:
        raise ValueError(f"max_bs and max_num_tokens must be >= 1, got {max_bs} and {max_num_tokens}")
    fixed = tuple((k, type(v), repr(v)) for k, v in params.items() if not (k in spec.params and spec.params[k].live))
    key = (id(spec), type(max_bs), int(max_bs), type(max_num_tokens), int(max_num_tokens), fixed)
    cached = _RESOLVED.get(key)
    if cached is not None and cached[0] is spec:
        return list(cached[1])
    resolved = _resolve_slots(spec, params, max_bs, max_num_tokens)
    if len(_RESOLVED) >= RESOLVED_CACHE_LIMIT:
        _RESOLVED.clear()
    _RESOLVED[key] = (spec, tuple(resolved))  # the spec kept alive: its id stays its own
    return resolved


def _resolve_slots(
    spec: RegistrySpec, params: Mapping[str, Any], max_bs: int, max_num_tokens: int
) -> List[ResolvedSlot]:
    resolved = []
    issues = []
    for i, slot in enumerate(spec.slots):

        def add(key: Optional[str], message: str) -> None:
            issues.append(SpecIssue(spec.path, spec.slot_line(i, key), message, slot.name))

        try:
            r = resolve_slot(slot, params, max_bs, max_num_tokens, spec.slot_line(i), spec.absent_fields)
        except ExprError as exc:  # division by zero or overflow with these values
            add(None, str(exc))
            continue
        except ChoiceError as exc:  # a padding or reset_to param's value that is no choice
            add(exc.key, str(exc))
            continue
        for key, message in tail_problems_of(slot, r, params) if r.enabled else ():
            add(key, message)
        if r.enabled and r.pad_value is not None and not value_fits_dtype(r.pad_value, r.dtype_name):
            add("pad_value", f"pad_value {r.pad_value!r} does not fit dtype {r.dtype_name}")
        bad = [(d, n) for d, n in enumerate(r.shape) if n < 1]
        if r.enabled and bad:
            d, n = bad[0]
            add("shape", f"shape[{d}] = {slot.shape[d]!r} evaluates to {n}; extents must be positive")
        resolved.append(r)
    if issues:
        raise SpecError(issues)
    return resolved
