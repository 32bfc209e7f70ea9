"""Hermes format (Qwen2.5, Hermes and many others).

Each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the
first call is content.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from .base import ParsedCall, ParsedOutput, call_from

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


class HermesToolParser:
    name: ClassVar[str] = "hermes"
    markers: ClassVar[tuple[str, ...]] = (OPEN,)
    at_start_only: ClassVar[bool] = False

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(OPEN)
        if start < 0:
            return ParsedOutput(text)
        calls = self._calls(text[start:], closed_only=False)
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(text[:start], calls)

    def complete_calls(self, calls_text: str) -> list[ParsedCall]:
        return self._calls(calls_text, closed_only=True)

    def _calls(self, text: str, *, closed_only: bool) -> list[ParsedCall]:
        bodies = BLOCK.findall(text)
        if not closed_only:
            tail = text[text.rfind(OPEN) :]
            if "</tool_call>" not in tail:  # an unclosed last call (cut by max_tokens)
                bodies.append(tail[len(OPEN) :].strip())
        calls = []
        for body in bodies:
            try:
                call = call_from(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        return calls
