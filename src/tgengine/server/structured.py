"""The constraint an OpenAI request asks for: ``response_format`` or ``structured_outputs``."""

from __future__ import annotations

from ..structured_outputs import StructuredOutputsParams
from .errors import invalid
from .protocol import SamplingFields


def requested_constraint(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint of ``body`` and the field it came from (for errors that name it).

    ``response_format`` ``json_object`` is any JSON object, ``json_schema`` its schema
    (``strict`` or not: the schema is always enforced), ``text`` nothing. vLLM's
    ``structured_outputs`` extra body takes one of json, json_object, regex, choice,
    grammar. Asking for both is a 400.
    """
    fmt, extra = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and extra is not None:
        raise invalid("structured_outputs", "give response_format or structured_outputs, not both")
    if extra is not None:
        fields = extra.model_dump(by_alias=True, exclude_none=True)
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
    return StructuredOutputsParams(json=schema), "response_format"
