"""JSON schema rewrites: vLLM's closed objects, and schemas embedded in a larger one.

Pure functions on plain JSON values; the input is never modified.

- ``forbid_additional_properties``: every object schema that names its properties and says
  nothing of others forbids them (``additionalProperties: false``), as vLLM's default does
  (xgrammar's strict mode; its guidance backend's ``disable_additional_properties``).
  llguidance follows JSON Schema, where unnamed properties are allowed, and has no option
  for this, so the schema is rewritten before it is compiled.
- ``embed_schemas``: several schemas as parts of one, each keeping its own ``$defs``.
  A ``$ref`` such as ``#/$defs/Options`` resolves against the root of the document, so a
  tool's parameters placed under ``properties.arguments`` would lose their definitions;
  here each schema moves into the root's ``$defs`` under a name of its own, with its
  definitions beside it and its local references rewritten to match. Two schemas that
  define the same name do not clash.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

# keywords whose value is a schema, a list of schemas, or a map of name -> schema
_SCHEMA = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties",
           "unevaluatedItems", "contains", "propertyNames", "not", "if", "then",
           "else")  # fmt: skip
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DEFS = ("$defs", "definitions")


def forbid_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where an object schema with ``properties`` (or
    ``patternProperties``) and no ``additionalProperties`` gets ``additionalProperties:
    false``. Values that are data, not schemas (``const``, ``enum``, ``default``,
    ``examples``), are left alone."""
    schema = copy.deepcopy(schema)
    for node in _schemas(schema):
        if "additionalProperties" not in node and (
            "properties" in node or "patternProperties" in node
        ):
            node["additionalProperties"] = False
    return schema


def embed_schemas(schemas: Sequence[Any], prefix: str = "part") -> tuple[list[Any], dict[str, Any]]:
    """``schemas`` as references into one set of definitions: ``(refs, defs)``.

    ``refs[i]`` is ``{"$ref": "#/$defs/<prefix><i>"}``, to be used where schema ``i``
    goes; ``defs`` is what the root's ``$defs`` must hold: each schema (its own
    definitions taken out) and its definitions as ``<prefix><i>.<name>``. Local references
    inside schema ``i`` are rewritten: ``#/$defs/X`` (or ``#/definitions/X``) to its
    definition, ``#`` and any other pointer to the schema's new place.
    """
    refs: list[Any] = []
    defs: dict[str, Any] = {}
    for i, schema in enumerate(schemas):
        key = f"{prefix}{i}"
        if not isinstance(schema, dict):  # true / false: nothing to refer to
            refs.append(schema)
            continue
        body = copy.deepcopy(schema)
        own = _take_defs(body)
        for node in _schemas(body, own.values()):
            ref = node.get("$ref")
            if isinstance(ref, str):
                node["$ref"] = _moved(ref, key)
        defs[key] = body
        defs.update({f"{key}.{name}": definition for name, definition in own.items()})
        refs.append({"$ref": f"#/$defs/{_escape(key)}"})
    return refs, defs


def _take_defs(body: dict[str, Any]) -> dict[str, Any]:
    """Remove ``$defs`` and ``definitions`` from ``body``; their entries (``$defs`` wins)."""
    own: dict[str, Any] = {}
    for field in reversed(_DEFS):
        value = body.pop(field, None)
        if isinstance(value, dict):
            own.update(value)
    return own


def _moved(ref: str, key: str) -> str:
    """Where the local reference ``ref`` of the schema now at ``$defs/<key>`` points."""
    if not ref.startswith("#"):
        return ref  # a remote reference: not resolvable here either way
    pointer = ref[1:]
    for field in _DEFS:
        head = f"/{field}/"
        if pointer.startswith(head):
            name, _, rest = pointer[len(head) :].partition("/")
            return f"#/$defs/{_escape(key + '.')}{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{_escape(key)}{pointer}"


def _escape(segment: str) -> str:
    """A JSON pointer segment (RFC 6901)."""
    return segment.replace("~", "~0").replace("/", "~1")


def _schemas(root: Any, more: Any = ()) -> list[dict[str, Any]]:
    """Every schema object in ``root`` (and in ``more``), itself included."""
    found: list[dict[str, Any]] = []
    stack = [root, *more]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.append(node)
        for keyword in _SCHEMA:
            value = node.get(keyword)
            if isinstance(value, dict):
                stack.append(value)
        for keyword in _SCHEMA_LISTS:
            value = node.get(keyword)
            if isinstance(value, list):
                stack.extend(value)
        for keyword in _SCHEMA_MAPS:
            value = node.get(keyword)
            if isinstance(value, dict):
                stack.extend(value.values())
    return found
