"""Llama 3.x JSON format: ``{"name": ..., "parameters": {...}}`` as the whole answer,
optionally after ``<|python_tag|>``, several calls separated by ``;``."""

from __future__ import annotations

import json
from typing import ClassVar

from .base import ParsedCall, ParsedOutput, call_from

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    name: ClassVar[str] = "llama3_json"
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "{")
    at_start_only: ClassVar[bool] = True

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        calls = _decode_calls(body)
        return ParsedOutput("", calls) if calls else ParsedOutput(text)

    def complete_calls(self, calls_text: str) -> list[ParsedCall]:
        return []  # a JSON object is only known to be a call once the answer ends


def _decode_calls(body: str) -> list[ParsedCall]:
    """Every call in ``body``; [] unless all of it is calls (then it is not content)."""
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return []
        call = call_from(obj, ("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls
