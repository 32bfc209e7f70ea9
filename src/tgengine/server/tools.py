"""Tool calling on chat: what the template sees, the constraint, and how the answer is read.

``tool_choice``:

- ``none``: the tools reach the template, the answer is plain content;
- ``auto`` (the default when there are tools): the model's own format is parsed
  (``tool_parsers``); calls found end with ``finish_reason="tool_calls"``;
- ``required``: the answer is constrained to a JSON array of ``{"name", "arguments"}``
  objects, one per call (at most one unless ``parallel_tool_calls``), each ``arguments``
  valid under its function's parameters;
- a named function: the answer is constrained to that function's arguments.

The constraint makes even a model never trained for tools return valid calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..structured_outputs import StructuredOutputsParams
from ..structured_outputs.schemas import embed_schemas
from .errors import invalid
from .protocol import ChatCompletionRequest, ChatMessage
from .structured import json_constraint
from .structured_protocol import FunctionCallDelta, ToolCallDelta, ToolSpec
from .tool_parsers import ParsedCall, ToolCallStream, ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolAnswer:
    """A whole answer: its content (None when it is only calls) and its calls."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class ToolDeltas:
    """What one streamed piece of the answer releases."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolOutput(Protocol):
    """Reads an answer as tool calls, whole or streamed; ``made_calls`` once it has."""

    made_calls: bool
    finish_reason_for_calls: str

    def whole(self, text: str) -> ToolAnswer: ...
    def feed(self, delta: str) -> ToolDeltas: ...
    def finish(self) -> ToolDeltas: ...


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None = None  # for the chat template
    constraint: StructuredOutputsParams | None = None
    output: ToolOutput | None = None


def plan_tools(
    body: ChatCompletionRequest, parser: ToolParser, *, closed_objects: bool = True
) -> ToolPlan:
    """The plan for ``body``'s tools; 400 for a choice that names no tool.

    Each tool's parameters keep their ``$defs``; with ``closed_objects`` (vLLM's default)
    arguments carry no property their schema does not name.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice: needs tools")
        return ToolPlan()
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if choice == "none":
        return ToolPlan(tools)
    if choice is None or choice == "auto":
        return ToolPlan(tools, output=ParsedToolOutput(parser))
    if choice == "required":
        schema = _calls_schema(body.tools, parallel=body.parallel_tool_calls is not False)
        constraint = json_constraint(schema, closed_objects=closed_objects)
        return ToolPlan(tools, constraint, RequiredToolOutput())
    assert not isinstance(choice, str)
    spec = next((t for t in body.tools if t.function.name == choice.function.name), None)
    if spec is None:
        name = choice.function.name
        raise invalid("tool_choice", f"tool_choice: no tool is named {name!r}")
    schema = spec.function.parameters or ANY_OBJECT
    arguments = json_constraint(schema, closed_objects=closed_objects)
    return ToolPlan(tools, arguments, NamedToolOutput(spec.function.name))


def _calls_schema(tools: list[ToolSpec], *, parallel: bool) -> dict[str, Any]:
    """An array of calls, each ``{"name", "arguments"}`` under one tool's parameters.

    The parameters go into the root's ``$defs`` (``tool0``, ``tool0.<its defs>``, ...),
    so that their own ``$ref``s still resolve and two tools' definitions never clash.
    """
    parameters = [tool.function.parameters or ANY_OBJECT for tool in tools]
    arguments, defs = embed_schemas(parameters, prefix="tool")
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": argument},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool, argument in zip(tools, arguments, strict=True)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it, tool calls and results included.

    Arguments go to the template decoded (templates write them with ``tojson``).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _decoded(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        out.append(item)
    return out


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_call_delta(index: int, call: ParsedCall) -> ToolCallDelta:
    return ToolCallDelta(
        index=index,
        id=new_call_id(),
        type="function",
        function=FunctionCallDelta(name=call.name, arguments=call.arguments),
    )


class ParsedToolOutput:
    """``auto``: the model's own tool-call format, parsed."""

    finish_reason_for_calls = "tool_calls"

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.made_calls = False
        self._stream = ToolCallStream(parser)

    def whole(self, text: str) -> ToolAnswer:
        parsed = self.parser.parse(text)
        self.made_calls = bool(parsed.calls)
        return ToolAnswer(parsed.content or (None if parsed.calls else ""), parsed.calls)

    def feed(self, delta: str) -> ToolDeltas:
        return self._deltas(self._stream.feed(delta))

    def finish(self) -> ToolDeltas:
        return self._deltas(self._stream.finish())

    def _deltas(self, piece: Any) -> ToolDeltas:
        first = self._stream.num_calls - len(piece.calls)
        deltas = [whole_call_delta(first + i, call) for i, call in enumerate(piece.calls)]
        self.made_calls = self.made_calls or bool(deltas)
        return ToolDeltas(piece.content, deltas)


class RequiredToolOutput:
    """``required``: a constrained JSON array of calls; streamed once it is complete."""

    finish_reason_for_calls = "tool_calls"

    def __init__(self) -> None:
        self.made_calls = False
        self._text = ""

    def whole(self, text: str) -> ToolAnswer:
        calls = _array_calls(text)
        self.made_calls = bool(calls)
        return ToolAnswer(None, calls) if calls else ToolAnswer(text)

    def feed(self, delta: str) -> ToolDeltas:
        self._text += delta
        return ToolDeltas()

    def finish(self) -> ToolDeltas:
        calls = _array_calls(self._text)
        if not calls:  # cut short (max_tokens): what there is, as content
            return ToolDeltas(self._text)
        self.made_calls = True
        return ToolDeltas(tool_calls=[whole_call_delta(i, c) for i, c in enumerate(calls)])


def _array_calls(text: str) -> list[ParsedCall]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
            calls.append(ParsedCall(item["name"], arguments))
    return calls


class NamedToolOutput:
    """A named function: the answer is its arguments, streamed as they are generated.

    Its finish reason stays ``stop``, as OpenAI's does for a named tool choice.
    """

    finish_reason_for_calls = "stop"

    def __init__(self, name: str) -> None:
        self.name = name
        self.made_calls = False

    def whole(self, text: str) -> ToolAnswer:
        self.made_calls = True
        return ToolAnswer(None, [ParsedCall(self.name, text)])

    def feed(self, delta: str) -> ToolDeltas:
        if not self.made_calls:
            self.made_calls = True
            head = ToolCallDelta(
                index=0,
                id=new_call_id(),  # made here: each choice (a copy of this) gets its own
                type="function",
                function=FunctionCallDelta(name=self.name, arguments=delta),
            )
            return ToolDeltas(tool_calls=[head])
        if not delta:
            return ToolDeltas()
        return ToolDeltas(
            tool_calls=[ToolCallDelta(index=0, function=FunctionCallDelta(arguments=delta))]
        )

    def finish(self) -> ToolDeltas:
        return self.feed("") if not self.made_calls else ToolDeltas()
