"""The interface every tool-call format implements, and the parsed result."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A model's answer split into plain content and the tool calls it made."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    """One model family's tool-call format.

    ``markers`` open the tool-call part of an answer; with ``at_start_only`` they count only
    at the start of the answer (after whitespace). ``parse`` splits a whole answer.
    ``complete_calls`` returns the calls already closed in a partial tool-call part (those
    that can be streamed before the answer ends); ``[]`` when the format cannot tell.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    at_start_only: ClassVar[bool]

    def parse(self, text: str) -> ParsedOutput: ...

    def complete_calls(self, calls_text: str) -> list[ParsedCall]: ...


def call_from(obj: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded ``{"name": ..., <arguments key>: {...}}``; None if not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):  # some models send the JSON text itself
                return ParsedCall(obj["name"], arguments)
            return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
    return ParsedCall(obj["name"], "{}")
