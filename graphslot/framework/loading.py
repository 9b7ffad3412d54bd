"""Reading spec files: YAML → structural validation → cross-key checks → RegistrySpec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

from pydantic import ValidationError

from .checks import check_spec
from .errors import SpecError, SpecIssue, did_you_mean, one_of
from .model import AXES, PADDINGS, PARAM_KEYS, PARAM_TYPES, SLOT_KEYS, TOP_KEYS, ParamSpec, RegistrySpec, SlotSpec
from .yaml_loader import Locations, load_yaml

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "slot_specs"
_CHOICES = {"axis": AXES, "padding": PADDINGS, "type": PARAM_TYPES, "device": ("cpu",)}


def shipped_spec_names() -> List[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def spec_path(name_or_path: Union[str, os.PathLike]) -> Path:
    """A shipped spec name (``decode``) or a path to a YAML file."""
    text = os.fspath(name_or_path)
    if text in shipped_spec_names():
        return SHIPPED_DIR / f"{text}.yaml"
    path = Path(text)
    if not path.is_file():
        raise SpecError([SpecIssue(text, None, "no such spec file; shipped specs are: "
                                   + one_of(shipped_spec_names()) + did_you_mean(text, shipped_spec_names()))])
    return path


def load_spec(name_or_path: Union[str, os.PathLike]) -> RegistrySpec:
    """Load a shipped spec by name or a spec file by path."""
    path = spec_path(name_or_path)
    return parse_spec(path.read_text(), source=_display_path(path))


def _display_path(path: Path) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return str(path) if relative.startswith("..") else relative


def parse_spec(text: str, source: str = "<string>") -> RegistrySpec:
    """Parse and validate spec text; raises SpecError listing every problem."""
    loaded = load_yaml(text, source)
    issues = list(loaded.issues)
    data = loaded.data
    if any(i.message.startswith("YAML syntax error") for i in issues):
        raise SpecError(issues)
    if not isinstance(data, dict):
        raise SpecError(issues + [SpecIssue(source, 1, "a spec is a mapping with keys "
                                            + ", ".join(TOP_KEYS))])
    spec = None
    try:
        spec = RegistrySpec.model_validate(data)
    except ValidationError as exc:
        issues.extend(_structural_issues(exc, data, loaded.locations))

    params = spec.params if spec else _valid_parts(data.get("params"), ParamSpec, dict)
    slots = (list(enumerate(spec.slots)) if spec
             else _valid_parts(data.get("slots"), SlotSpec, list))
    presets = data.get("presets") if isinstance(data.get("presets"), dict) else {}
    presets = {k: v for k, v in presets.items() if isinstance(v, dict)}
    issues.extend(check_spec(params, presets, slots, source, loaded.locations))
    if issues:
        raise SpecError(sorted(issues, key=lambda i: (i.line or 0)))
    spec._source, spec._text, spec._locations = source, text, loaded.locations
    return spec


def _valid_parts(raw: Any, model, container):
    """The entries of a params mapping or slots list that validate on their own."""
    if container is dict:
        items = raw.items() if isinstance(raw, dict) else ()
        out: Dict[str, Any] = {}
        for key, value in items:
            try:
                out[key] = model.model_validate(value)
            except ValidationError:
                pass
        return out
    parts: List[Tuple[int, Any]] = []
    for index, value in enumerate(raw if isinstance(raw, list) else ()):
        try:
            parts.append((index, model.model_validate(value)))
        except ValidationError:
            pass
    return parts


def _document_path(loc: Tuple[Any, ...], data: Any) -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """Split a pydantic ``loc`` into the part that exists in the document and the rest
    (union-member tags such as ``'int'``, or the name of a missing key)."""
    node, path = data, []
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return tuple(path), tuple(loc[i:])
        path.append(part)
    return tuple(path), ()


def _allowed_keys(path: Tuple[Any, ...]) -> Tuple[str, ...]:
    if len(path) == 2 and path[0] == "slots":
        return SLOT_KEYS
    if len(path) == 2 and path[0] == "params":
        return PARAM_KEYS
    return TOP_KEYS if not path else ()


def _structural_issues(exc: ValidationError, data: Any, locations: Locations) -> List[SpecIssue]:
    seen, issues = set(), []
    for error in exc.errors():
        path, rest = _document_path(error["loc"], data)
        kind = error["type"]
        if rest[-1:] == ("[key]",):
            message = (f"key {error['input']!r} is not a string: YAML reads unquoted on/off/yes/no/true/false "
                       "and numbers as such; quote it")
        elif kind == "missing":
            key = rest[0] if rest else "?"
            message = f"missing required key '{key}'"
        elif kind == "extra_forbidden":
            key, parent = path[-1], path[:-1]
            allowed = _allowed_keys(parent)
            hint = did_you_mean(key, allowed) or (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
            message = f"unknown key '{key}'{hint}"
        elif kind == "literal_error" and path and path[-1] in _CHOICES:
            key, choices = path[-1], _CHOICES[path[-1]]
            message = (f"'{error['input']}' is not a valid {key} (one of: {', '.join(choices)})"
                       + did_you_mean(error["input"], choices))
        else:
            key = ".".join(str(p) for p in path[2:] or path[-1:]) or "spec"
            message = f"bad value for '{key}': {error['msg'].lower()} (got {error['input']!r})"
        # A union field yields one error per member type: report the value once.
        dedup = (path, message) if kind in ("missing", "extra_forbidden") else (path, "value")
        if dedup in seen:
            continue
        seen.add(dedup)
        issues.append(SpecIssue(locations.file, locations.line(path), message, _slot_name(path, data)))
    return issues


def _slot_name(path: Tuple[Any, ...], data: Any):
    if len(path) >= 2 and path[0] == "slots" and isinstance(data.get("slots"), list):
        slot = data["slots"][path[1]]
        if isinstance(slot, dict) and isinstance(slot.get("name"), str):
            return slot["name"]
    return None
