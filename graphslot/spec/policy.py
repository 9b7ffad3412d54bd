"""The rules that tie a slot's tail to its other keys (padding, pad_value, index, extra_rows, reset_to, staged) under
one param set. ``padding`` and ``reset_to`` may name a ``str`` param, so validation runs the rules under the defaults
and under every preset (:func:`tail_issues`, from :mod:`.checks`) and a build under its own params (:mod:`.resolve`):
a choice is checked wherever it is made. Torch-free."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .errors import ExprError, did_you_mean, shorten
from .expr import evaluate_field
from .kinds import INDEX_SKIP, Axis, Padding, ResetTo
from .model import ParamSpec, SlotSpec

#: The keys that take a choice or the name of a ``str`` param whose value is one.
CHOICES = {"padding": Padding.values(), "reset_to": ResetTo.values()}
Problem = Tuple[Optional[str], str]  # (the slot key to point at, None: the slot; the message)
#: A declared pad value whose expression does not evaluate under a param set (reported where it is checked).
UNKNOWN = object()


class Tail(NamedTuple):
    """A slot's tail keys under one param set: the choices made, the pad value evaluated (None: not declared)."""

    axis: Axis
    padding: Optional[Padding]  # None: not declared
    reset_to: ResetTo
    pad_value: Any
    index: Any  # False, True or "skip"
    extra_rows: int
    staged: bool
    host: bool
    padding_param: bool  # padding names a param: a pad_value its policy takes none of is unused, not an error


class ChoiceError(ValueError):
    """A ``padding`` or ``reset_to`` naming a param whose value is not a choice; ``key`` is which."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def choice_param(slot: SlotSpec, key: str, params: Mapping[str, ParamSpec]) -> Optional[str]:
    """The param ``slot.<key>`` names, or None for a literal choice (or none declared)."""
    value = getattr(slot, key)
    return value if value is not None and value not in CHOICES[key] and value in params else None


def chosen(slot: SlotSpec, key: str, values: Mapping[str, Any]) -> Optional[str]:
    """``slot.<key>``'s choice under the param values ``values``; ValueError saying why it is none."""
    declared = getattr(slot, key)
    choices = CHOICES[key]
    if declared is None or declared in choices:
        return declared
    value = values.get(declared)
    if value not in choices:
        got = shorten(value) if isinstance(value, str) else f"{type(value).__name__} {shorten(value)}"
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ChoiceError(
            key,
            f"{key} names param '{declared}', whose value {got} is not a valid {key} (one of: {', '.join(choices)})"
            + hint,
        )
    return value


def tail_of(slot: SlotSpec, padding: Optional[str], reset_to: str, pad_value: Any, padding_param: bool) -> Tail:
    policy = None if padding is None else Padding(padding)
    host = slot.device == "cpu"
    return Tail(
        Axis(slot.axis),
        policy,
        ResetTo(reset_to),
        pad_value,
        slot.index,
        slot.extra_rows,
        slot.staged,
        host,
        padding_param,
    )


def tail_problems(t: Tail) -> List[Problem]:
    """Every rule the tail keys break, in the order the contract states them."""
    problems: List[Problem] = []
    policy = Padding.KEEP_PAD if t.padding is None else t.padding
    if not t.axis.sliced:
        if policy.writes_tail:
            problems.append(
                (
                    "padding",
                    f"axis 'none' is never sliced, so padding '{policy}' would never "
                    "reset anything; use keep_pad, or fill_once to initialise the buffer",
                )
            )
        if t.extra_rows:
            problems.append(
                (
                    "extra_rows",
                    "extra_rows needs axis 'bs' or 'tokens': an axis-'none' slot is never "
                    "sliced, so it has no head to lengthen",
                )
            )
    elif t.padding is None:
        problems.append(
            (
                None,
                f"missing 'padding': a '{t.axis}'-axis slot must say how its padded tail is "
                f"made safe (one of {', '.join(Padding.values())})",
            )
        )
    if t.extra_rows < 0:
        problems.append(("extra_rows", f"extra_rows must be 0 or more, got {t.extra_rows}"))
    problems += _index_problems(t, policy)
    needs = policy.needs_pad_value
    if needs and t.pad_value is None:
        problems.append((None, f"padding '{policy}' needs a 'pad_value'"))
    elif not needs and t.pad_value is not None and not t.padding_param:
        problems.append(
            (
                "pad_value",
                f"pad_value is only used by fill_sentinel and fill_once, not "
                f"'{policy}'; remove it or change the padding",
            )
        )
    if t.reset_to is ResetTo.CAPACITY and not policy.writes_tail:
        problems.append(
            (
                "reset_to",
                f"reset_to 'capacity' applies to the policies that write the tail (zero, "
                f"fill_sentinel, repeat_last); '{policy}' writes none, so there is nothing to reset to the "
                "end: remove reset_to or change the padding",
            )
        )
    if t.staged and t.host:
        problems.append(
            (
                "staged",
                "staged: true and device: cpu exclude each other: a staged slot has a host "
                "buffer the fill writes and a device buffer the graph reads; a device: cpu slot is the "
                "host buffer alone",
            )
        )
    return problems


def _index_problems(t: Tail, policy: Padding) -> List[Problem]:
    if t.index is True and policy is Padding.REPEAT_LAST and t.extra_rows < 1:
        return [
            (
                "index",
                "index slots may use padding 'repeat_last' only with extra_rows >= 1 (cu_seqlens-style "
                "offsets, where a repeated value is an empty request); else use 'zero': a repeated index would "
                "send the padded rows to a real row",
            )
        ]
    if t.index is True and policy not in (Padding.ZERO, Padding.REPEAT_LAST):
        return [
            (
                "index",
                f"index slots must use padding 'zero' (got '{policy}'): "
                "a stale or sentinel tail would index out of the pool",
            )
        ]
    if t.index != INDEX_SKIP:
        return []
    if policy is not Padding.FILL_SENTINEL:
        return [
            (
                "index",
                f"index: skip slots must use padding 'fill_sentinel' with a negative pad_value (got "
                f"'{policy}'): their kernels skip the rows holding it",
            )
        ]
    value = t.pad_value
    if value is not None and value is not UNKNOWN and not (type(value) is int and value < 0):
        return [
            (
                "pad_value",
                f"index: skip needs a negative integer pad_value, got {shorten(value)}: a negative "
                "value indexes no row (a kernel that forgot to skip it fails loudly), a zero or more would "
                "silently write into a real row",
            )
        ]
    return []


def tail_issues(
    slot: SlotSpec, params: Mapping[str, ParamSpec], param_sets: Sequence[Tuple[Optional[str], Mapping[str, Any]]]
) -> List[Problem]:
    """Validation's tail rules: the references ``padding`` and ``reset_to`` make, then :func:`tail_problems` under
    each param set (``(preset or None, values)``; empty when the params are broken), each problem once."""
    problems: List[Problem] = []
    named: Dict[str, Optional[str]] = {}
    for key in CHOICES:
        declared = getattr(slot, key)
        reference = _reference_problem(key, declared, params)
        if reference is not None:
            problems.append((key, reference))
        named[key] = choice_param(slot, key, params)
    if problems or (not param_sets and any(named.values())):
        return problems  # a choice that names no valid param, or params that do not resolve: nothing to check
    seen = set()
    for preset, values in param_sets or [(None, {})]:
        made = {}
        try:
            for key in CHOICES:
                made[key] = chosen(slot, key, values)
        except ChoiceError as exc:
            problems.append((exc.key, str(exc) + _where(preset, {})))
            continue
        try:
            pad_value = evaluate_field(slot.pad_value, values)
        except (ExprError, KeyError):
            pad_value = UNKNOWN  # reported by the pad_value check
        tail = tail_of(slot, made["padding"], made["reset_to"], pad_value, named["padding"] is not None)
        shown = {named[key]: made[key] for key in CHOICES if named[key] is not None}
        for problem in tail_problems(tail):
            if problem not in seen:
                seen.add(problem)
                problems.append((problem[0], problem[1] + _where(preset, shown)))
    return problems


def _reference_problem(key: str, declared: Any, params: Mapping[str, ParamSpec]) -> Optional[str]:
    """What is wrong with naming ``declared`` for ``key``: neither a choice nor a str param, or a param of another
    type or a live one; None when it is fine."""
    choices = CHOICES[key]
    if declared is None or declared in choices:
        return None
    param = params.get(declared)
    if param is None:
        str_params = [n for n, p in params.items() if p.type == "str"]
        also = " or a str param" if str_params else ""
        return (
            f"'{shorten(declared, quote=False)}' is not a valid {key} (one of: {', '.join(choices)}){also}"
            + did_you_mean(declared, list(choices) + str_params)
        )
    if param.type != "str":
        return f"param '{declared}' is {param.type}, not a str (a {key} param's value is one of: {', '.join(choices)})"
    if param.live:
        return (
            f"{key} names live param '{declared}': the choice decides what a fill does and what code is generated, "
            "and live params are read only by hooks at fill time"
        )
    return None


def _where(preset: Optional[str], shown: Mapping[str, Any]) -> str:
    """`` (with preset 'cpu': p = 'padded')``: where a problem arises, when not plainly under the defaults."""
    made = ", ".join(f"{name} = '{value}'" for name, value in shown.items())
    if preset is not None:
        return f" (with preset '{shorten(str(preset), quote=False)}'" + (f": {made})" if made else ")")
    return f" (under the defaults: {made})" if made else ""
