"""The JSON Schema editors use, and its checked-in copy."""

from __future__ import annotations

import json

import pytest
import yaml

from graphslot.spec.hooks import BUILTIN_HOOKS
from graphslot.spec.loading import SHIPPED_DIR, shipped_spec_names
from graphslot.spec.model import PADDINGS, PARAM_KEYS, SLOT_KEYS, TOP_KEYS
from graphslot.spec.schema import SCHEMA_FILE_NAME, schema_text, spec_json_schema

SHIPPED_SCHEMA = SHIPPED_DIR / SCHEMA_FILE_NAME


def shipped_documents():
    return [yaml.safe_load((SHIPPED_DIR / f"{name}.yaml").read_text()) for name in shipped_spec_names()]


def test_shipped_schema_is_up_to_date():
    assert SHIPPED_SCHEMA.read_text(encoding="utf-8") == schema_text(), (
        "graphslot/slot_specs/graphslot.schema.json is out of date with the spec model; regenerate it with "
        "`graphslot schema --output graphslot/slot_specs/graphslot.schema.json`"
    )


def test_schema_is_deterministic():
    assert schema_text() == schema_text()
    assert json.loads(schema_text()) == spec_json_schema()
    assert schema_text().endswith("}\n")


def test_schema_header():
    schema = spec_json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "graphslot slot spec"
    assert "$id" not in schema
    assert schema["additionalProperties"] is False


def test_schema_lists_every_key():
    schema = spec_json_schema()
    assert set(schema["properties"]) == set(TOP_KEYS)
    assert set(schema["$defs"]["SlotSpec"]["properties"]) == set(SLOT_KEYS)
    assert set(schema["$defs"]["ParamSpec"]["properties"]) == set(PARAM_KEYS)
    assert schema["$defs"]["SlotSpec"]["additionalProperties"] is False


def test_schema_accepts_shipped_top_level_keys():
    schema = spec_json_schema()
    for document in shipped_documents():
        assert set(document) <= set(schema["properties"])
        assert set(schema["required"]) <= set(document)
        for slot in document["slots"]:
            assert set(slot) <= set(schema["$defs"]["SlotSpec"]["properties"])


def test_expression_fields_say_so():
    slot = spec_json_schema()["$defs"]["SlotSpec"]["properties"]
    for key in ("shape", "pad_value", "enabled_if"):
        assert "expression" in slot[key]["description"].lower(), key


def test_schema_validates_shipped_specs():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(spec_json_schema())
    jsonschema.Draft202012Validator.check_schema(spec_json_schema())
    for document in shipped_documents():
        assert list(validator.iter_errors(document)) == []
    bad = dict(shipped_documents()[0], slots=[{"name": "x", "shape": [1], "dtype": "int64", "axis": "batch"}])
    assert list(validator.iter_errors(bad))


def test_format_documentation_lists_every_key_and_builtin_hook():
    readme = (SHIPPED_DIR / "README.md").read_text(encoding="utf-8")
    missing = [f"`{word}`" for word in (*TOP_KEYS, *PARAM_KEYS, *SLOT_KEYS, *PADDINGS, *BUILTIN_HOOKS)
               if f"`{word}`" not in readme]
    assert not missing, f"graphslot/slot_specs/README.md does not document {', '.join(missing)}"
