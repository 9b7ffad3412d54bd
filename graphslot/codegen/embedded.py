"""The spec a generated module carries, so ``build_registry(module)`` runs without the YAML it came from.

The module's last constants are ``SPEC_SOURCE`` (the spec file's label) and ``SPEC_JSON`` (the canonical form
``SPEC_IDENTITY`` is the sha256 of) as escaped literals, one param and slot a line. Read back it is data: its
sha256 checked, parsed with ``json.loads`` and validated like a spec file. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional

from pydantic import ValidationError

from ..spec.checks import check_spec
from ..spec.errors import SpecError, SpecIssue, shorten
from ..spec.loading import is_shipped
from ..spec.model import RegistrySpec
from ..spec.yaml_loader import Locations

#: How a module generated from a shipped spec by name labels it (``graphslot generate``).
SHIPPED_LABEL = "graphslot:slot_specs/{}.yaml"
#: Longest SPEC_JSON read back (a spec's canonical form is tens of KiB).
MAX_SPEC_JSON = 16 << 20


def _dump(value: Any) -> str:
    """One value as :meth:`RegistrySpec.canonical_json` writes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def canonical_parts(spec: RegistrySpec) -> List[str]:
    """``spec.canonical_json()`` in pieces: one per param, preset and slot, its comma leading, so a slot
    added changes no other piece."""
    canonical = spec.canonical()
    parts = ["{"]
    for i, key in enumerate(sorted(canonical)):
        value = canonical[key]
        head = ("," if i else "") + _dump(key) + ":"
        if isinstance(value, dict) and value:
            parts[-1] += head + "{"
            parts += [("," if j else "") + _dump(k) + ":" + _dump(value[k]) for j, k in enumerate(sorted(value))]
            parts.append("}")
        elif isinstance(value, list) and value:
            parts[-1] += head + "["
            parts += [("," if j else "") + _dump(v) for j, v in enumerate(value)]  # appending one adds lines only
            parts.append("]")
        else:
            parts[-1] += head + _dump(value)
    parts[-1] += "}"
    return parts if "".join(parts) == spec.canonical_json() else [spec.canonical_json()]  # in pieces, or whole


def module_name(module: Any) -> str:
    return shorten(str(getattr(module, "__name__", None) or repr(module)), quote=False)


def module_params(module: Any) -> Dict[str, Any]:
    params = getattr(module, "PARAMS", None)
    return dict(params) if isinstance(params, dict) else {}


def refuse_foreign(module: Any, source: str, instead: str) -> None:
    """SpecError when ``module`` is no graphslot-generated module at all (it has none of what every module of every
    format records), saying what to pass ``instead``."""
    if not any(hasattr(module, record) for record in ("GRAPHSLOT_VERSION", "SPEC_IDENTITY", "SPEC_JSON")):
        records = "GRAPHSLOT_VERSION, SPEC_IDENTITY or SPEC_JSON"
        message = f"module '{module_name(module)}' is not a graphslot-generated module (it has no {records})"
        raise SpecError([SpecIssue(source, None, f"{message}: pass {instead} or a module `graphslot generate` wrote")])


def module_spec(module: Any) -> RegistrySpec:
    """The spec embedded in a generated module, validated; SpecError when it is not what SPEC_IDENTITY says."""
    name = module_name(module)
    refuse_foreign(module, f"<module {name}>", "build_registry a spec (a RegistrySpec, a spec name or a YAML path)")
    label = getattr(module, "SPEC_SOURCE", None)
    source = f"{shorten(label, quote=False) if isinstance(label, str) else '<unknown spec>'} (embedded in {name})"
    text = getattr(module, "SPEC_JSON", None)
    identity = getattr(module, "SPEC_IDENTITY", None)
    regenerate = "regenerate it (graphslot generate)"
    readable = isinstance(text, str) and len(text) <= MAX_SPEC_JSON and text.isascii()
    if not readable or hashlib.sha256(text.encode("ascii")).hexdigest() != identity:
        message = "carries a spec that is not the one its SPEC_IDENTITY names; the module was edited or damaged"
        raise SpecError([SpecIssue(source, None, f"generated module '{name}' {message}: {regenerate}")])
    try:
        spec = RegistrySpec.model_validate(json.loads(text))
    except (ValueError, RecursionError) as exc:  # ValidationError is a ValueError
        detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) and exc.errors() else str(exc)
        message = f"carries a spec this graphslot cannot read ({shorten(detail, 200, quote=False)})"
        raise SpecError([SpecIssue(source, None, f"generated module '{name}' {message}: {regenerate}")]) from None
    locations = Locations(source)
    slots = list(enumerate(spec.slots))
    options = dict(name=spec.name, max_bytes=None, structurally_valid=True)
    issues = check_spec(spec.params, spec.presets, slots, source, locations, **options)
    if issues:
        raise SpecError(issues)
    spec._source = source
    spec._locations = locations
    return spec


def same_spec_file(label: Any, source: str) -> Optional[bool]:
    """Whether a module's ``SPEC_SOURCE`` (relative to its project root) and a spec's ``source`` are one file;
    None when that cannot be told (a spec from text, a label climbing out of its root)."""
    if not isinstance(label, str):
        return None
    prefix = SHIPPED_LABEL.split("{}")[0]
    if label.startswith(prefix):
        return is_shipped(source) and Path(source).name == label[len(prefix) :]
    parts = PurePosixPath(label).parts
    path = Path(source)
    if not parts or ".." in parts or PurePosixPath(label).is_absolute() or not path.is_file():
        return None
    return path.resolve().parts[-len(parts) :] == parts
