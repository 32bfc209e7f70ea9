"""The JSON schema rewrites the server applies: closed objects, and embedded ``$defs``."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest

from tgengine.structured_outputs.schemas import embed_schemas, forbid_additional_properties

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"anyOf": [{"type": "object", "properties": {"y": {}}}, {"type": "null"}]},
        "c": {"type": "array", "items": {"type": "object", "patternProperties": {"^z": {}}}},
        "open": {"type": "object", "properties": {"w": {}}, "additionalProperties": True},
        "data": {"const": {"properties": {"not": "a schema"}}},
        "properties": {"type": "object", "properties": {"v": {}}},  # a property so named
    },
    "$defs": {"D": {"type": "object", "properties": {"d": {}}}},
}


def test_objects_that_name_properties_are_closed_unless_they_say_otherwise() -> None:
    before = copy.deepcopy(NESTED)
    closed = forbid_additional_properties(NESTED)
    assert NESTED == before, "the input is not modified"
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["b"]["anyOf"][1]
    assert props["c"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["data"] == NESTED["properties"]["data"], "a const is data, not a schema"
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]["properties"]
    assert closed["$defs"]["D"]["additionalProperties"] is False
    jsonschema.validate({"a": {"x": 1}}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {"x": 1, "extra": 2}}, closed)


def options(schema: dict[str, Any], field: str = "$defs") -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"options": {"$ref": f"#/{field}/Options"}, "again": {"$ref": "#"}},
        field: {"Options": schema},
    }


def test_embedded_schemas_keep_their_own_definitions() -> None:
    unit = options({"enum": ["c", "f"]})
    count = options({"type": "integer"}, field="definitions")  # draft-07's name
    refs, defs = embed_schemas([unit, count, True], prefix="tool")
    assert refs == [{"$ref": "#/$defs/tool0"}, {"$ref": "#/$defs/tool1"}, True]
    assert set(defs) == {"tool0", "tool0.Options", "tool1", "tool1.Options"}
    assert defs["tool0"]["properties"]["options"] == {"$ref": "#/$defs/tool0.Options"}
    assert defs["tool1"]["properties"]["options"] == {"$ref": "#/$defs/tool1.Options"}
    assert defs["tool0"]["properties"]["again"] == {"$ref": "#/$defs/tool0"}
    assert "$defs" not in defs["tool0"] and "definitions" not in defs["tool1"]
    assert unit == options({"enum": ["c", "f"]}), "the input is not modified"
    both = {"type": "array", "prefixItems": refs[:2], "$defs": defs}
    jsonschema.validate([{"options": "c"}, {"options": 3}], both)
    for clash in ([{"options": 3}, {"options": 3}], [{"options": "c"}, {"options": "c"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(clash, both)
