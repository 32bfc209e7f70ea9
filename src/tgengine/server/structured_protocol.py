"""Wire models for structured outputs and tool calling (OpenAI's and vLLM's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):  # as protocol.StrictModel, which imports this module
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaSpec(StrictModel):
    """``response_format.json_schema``: the schema the answer must match.

    ``strict`` is accepted either way: tgengine always enforces the schema.
    """

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsBody(StrictModel):
    """vLLM's ``structured_outputs`` extra body: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# -- responses ---------------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionCallDelta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One piece of a streamed tool call: the first has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
