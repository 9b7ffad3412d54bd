"""The spec a generated module carries, so that the module runs on its own:
``build_registry(module)`` from any working directory, without the YAML it came from.

A module (format 3) ends its constants with ``SPEC_SOURCE`` (the label of the spec file
it was generated from) and ``SPEC_JSON``: the spec's canonical form
(:meth:`RegistrySpec.canonical_json`, what ``SPEC_IDENTITY`` is the sha256 of), written
as string literals (``py_str``, so spec text reaches the module only as escaped
literals, and the skeleton check compares the value with the expected one), one param
and one slot a line, so a change of the spec changes the lines it touches.

Read back (:func:`module_spec`), it is data, never code: its sha256 must be the
module's ``SPEC_IDENTITY``, it is parsed with ``json.loads`` and validated like a spec
file (the model, then every cross-key check). Torch-free.
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

__all__ = [
    "GENERATED_RECORDS",
    "SHIPPED_LABEL",
    "canonical_parts",
    "module_name",
    "module_params",
    "module_spec",
    "refuse_foreign",
    "same_spec_file",
]

#: How a module generated from a shipped spec by name labels it (``graphslot generate``).
SHIPPED_LABEL = "graphslot:slot_specs/{}.yaml"
#: Longest SPEC_JSON read back (a spec's canonical form is tens of KiB).
MAX_SPEC_JSON = 16 << 20


def _dump(value: Any) -> str:
    """One value as :meth:`RegistrySpec.canonical_json` writes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def canonical_parts(spec: RegistrySpec) -> List[str]:
    """``spec.canonical_json()`` cut into pieces (their concatenation is the text): a
    piece per param, preset and slot, and the keys around them. A piece's comma leads it,
    so a slot (or param) added changes no other piece, at the end as in the middle."""
    canonical = spec.canonical()
    parts = ["{"]
    keys = sorted(canonical)
    for i, key in enumerate(keys):
        value, comma = canonical[key], "," if i < len(keys) - 1 else ""
        if isinstance(value, (dict, list)) and value:
            is_dict = isinstance(value, dict)
            parts[-1] += _dump(key) + (":{" if is_dict else ":[")
            items = [_dump(k) + ":" + _dump(value[k]) for k in sorted(value)] if is_dict else [_dump(v) for v in value]
            parts += [("," if j else "") + item for j, item in enumerate(items)]  # appending one adds lines only
            parts.append(("}" if is_dict else "]") + comma)
        else:
            parts[-1] += _dump(key) + ":" + _dump(value) + comma
    parts[-1] += "}"
    if "".join(parts) != spec.canonical_json():  # the same text, in pieces, or all of it at once
        return [spec.canonical_json()]
    return parts


def module_name(module: Any) -> str:
    return shorten(str(getattr(module, "__name__", None) or repr(module)), quote=False)


def module_params(module: Any) -> Dict[str, Any]:
    """The params a module was generated for (its baked ``PARAMS``)."""
    params = getattr(module, "PARAMS", None)
    return dict(params) if isinstance(params, dict) else {}


def _refuse(module: Any, source: str, message: str) -> SpecError:
    return SpecError([SpecIssue(source, None, f"generated module '{module_name(module)}' {message}")])


#: What every generated module records, of every format; a module with none of them is
#: not one (rather than an edited or damaged one).
GENERATED_RECORDS = ("GRAPHSLOT_VERSION", "SPEC_IDENTITY", "SPEC_JSON")


def refuse_foreign(module: Any, source: str, instead: str) -> None:
    """SpecError when ``module`` is not a graphslot-generated module at all, saying what
    to pass ``instead``."""
    if not any(hasattr(module, record) for record in GENERATED_RECORDS):
        raise SpecError(
            [
                SpecIssue(
                    source,
                    None,
                    f"module '{module_name(module)}' is not a graphslot-generated "
                    f"module (it has no {', '.join(GENERATED_RECORDS[:-1])} or "
                    f"{GENERATED_RECORDS[-1]}): pass {instead} or a module "
                    "`graphslot generate` wrote",
                )
            ]
        )


def module_spec(module: Any) -> RegistrySpec:
    """The spec embedded in a generated module, validated; SpecError when the module
    carries none or one that is not what its SPEC_IDENTITY says (the handshake already
    refused formats from before the spec was embedded)."""
    name = module_name(module)
    refuse_foreign(module, f"<module {name}>", "build_registry a spec (a RegistrySpec, a spec name or a YAML path)")
    label = getattr(module, "SPEC_SOURCE", None)
    source = f"{shorten(label, quote=False) if isinstance(label, str) else '<unknown spec>'} (embedded in {name})"
    text, identity = getattr(module, "SPEC_JSON", None), getattr(module, "SPEC_IDENTITY", None)
    if (
        not isinstance(text, str)
        or len(text) > MAX_SPEC_JSON
        or not text.isascii()
        or hashlib.sha256(text.encode("ascii")).hexdigest() != identity
    ):
        raise _refuse(
            module,
            source,
            "carries a spec that is not the one its SPEC_IDENTITY names; the module was "
            "edited or damaged: regenerate it (graphslot generate)",
        )
    try:
        data = json.loads(text)
        spec = RegistrySpec.model_validate(data)
    except (ValueError, RecursionError) as exc:  # ValidationError is a ValueError
        detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) and exc.errors() else str(exc)
        raise _refuse(
            module,
            source,
            f"carries a spec this graphslot cannot read "
            f"({shorten(detail, 200, quote=False)}): regenerate it "
            "(graphslot generate)",
        ) from None
    locations = Locations(source)
    issues = check_spec(
        spec.params,
        spec.presets,
        list(enumerate(spec.slots)),
        source,
        locations,
        name=spec.name,
        max_bytes=None,
        structurally_valid=True,
    )
    if issues:
        raise SpecError(issues)
    spec._source, spec._locations = source, locations
    return spec


def same_spec_file(label: Any, source: str) -> Optional[bool]:
    """Whether a module's ``SPEC_SOURCE`` (relative to the project root it was generated
    in) and a spec's ``source`` (as loaded here) are one file; None when that cannot be
    told (a spec from text, a label climbing out of its root)."""
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
