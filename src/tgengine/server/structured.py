"""The constraint an OpenAI request asks for: ``response_format`` or ``structured_outputs``."""

from __future__ import annotations

import json
from typing import Any

from ..structured_outputs import StructuredOutputsParams
from ..structured_outputs.schemas import forbid_additional_properties
from .errors import invalid
from .protocol import SamplingFields


def requested_constraint(
    body: SamplingFields, *, closed_objects: bool = True
) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint of ``body`` and the field it came from (for errors that name it).

    ``response_format`` ``json_object`` is any JSON object, ``json_schema`` its schema
    (``strict`` or not: the schema is always enforced), ``text`` nothing. vLLM's
    ``structured_outputs`` extra body takes one of json, json_object, regex, choice,
    grammar. Asking for both is a 400. With ``closed_objects`` (vLLM's default) a JSON
    schema's objects carry no property it does not name, unless it says
    ``additionalProperties``.
    """
    fmt, extra = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise invalid("structured_outputs", "give response_format or structured_outputs, not both")
    if extra is not None:
        fields = extra.model_dump(by_alias=True, exclude_none=True)
        if "json" in fields and closed_objects:
            fields["json"] = forbid_additional_properties(_schema(fields["json"]))
        return StructuredOutputsParams.coerce(fields), "structured_outputs"
    if fmt is None or fmt.type == "text":
        return None, "response_format"
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None:
        raise invalid("response_format", "response_format: json_schema needs its json_schema")
    schema = fmt.json_schema.schema_
    if schema is None:
        raise invalid("response_format", "response_format: json_schema.schema is missing")
    return json_constraint(schema, closed_objects=closed_objects), "response_format"


def json_constraint(schema: Any, *, closed_objects: bool) -> StructuredOutputsParams:
    """The constraint of one JSON schema, its objects closed or not."""
    if closed_objects:
        schema = forbid_additional_properties(schema)
    return StructuredOutputsParams(json=schema)


def _schema(value: Any) -> Any:
    """vLLM's ``structured_outputs.json`` may be the schema's JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # StructuredOutputsParams names the problem
