"""The JSON Schema of the spec format, generated from the pydantic model. Editors use the
checked-in copy, ``slot_specs/graphslot.schema.json``, to flag unknown keys and bad choices as
a spec is typed (``graphslot validate`` also runs the cross-key checks); CI compares it."""

from __future__ import annotations

import json
from typing import Any, Dict

from .expr import ALLOWED
from .model import RegistrySpec

SCHEMA_FILE_NAME = "graphslot.schema.json"


def spec_json_schema() -> Dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file."""
    schema = RegistrySpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "graphslot slot spec"
    # Expression strings are only checked by `graphslot validate`; say so where editors show it.
    schema["description"] = (
        "A graphslot spec: one registry of static input buffers. Strings in shape, pad_value, "
        f"enabled_if and param defaults are expressions ({ALLOWED}) over params, max_bs and "
        "max_num_tokens. Run `graphslot validate` for the cross-key checks."
    )
    return schema


def schema_text() -> str:
    """The schema as the checked-in file holds it (keys sorted: the same text every time)."""
    return json.dumps(spec_json_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
