"""The rules that relate a spec's keys to each other, run on the parts of a spec that passed
structural (pydantic) validation: the params' and presets' (:mod:`.param_checks`), each
slot's (:mod:`.slot_checks`), then the spec's total bytes. Every problem is reported."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import ExprError, SpecIssue, shorten
from .kinds import CAPACITY_NAMES
from .model import ParamSpec, SlotSpec
from .names import char_name, control_character, is_identifier
from .param_checks import MAX_PARAM_CHAIN as MAX_PARAM_CHAIN
from .param_checks import Reporter, check_param_chains, check_params, check_presets, param_value_sets
from .resolve import evaluate_field, slot_dtype
from .slot_checks import MAX_RANK as MAX_RANK, RESERVED_SLOT_NAMES as RESERVED_SLOT_NAMES, SlotChecker
from .yaml_loader import Locations

# The cap on the bytes a spec may declare, summed over its enabled slots at
# VALIDATION_CAPACITIES, under the defaults and under each preset. Override per call
# (parse_spec/load_spec(max_bytes=N), `graphslot validate --max-bytes N`).
DEFAULT_MAX_BYTES = 4 << 30
VALIDATION_CAPACITIES = dict.fromkeys(CAPACITY_NAMES, 256)


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
    chains_ok = check_param_chains(params, report)
    default_values = param_value_sets(params, presets, file, locations, report) if chains_ok else []
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
