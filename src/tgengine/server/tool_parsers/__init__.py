"""Tool-call parsers: one module per model family's format, behind ``ToolParser``.

``auto`` picks by the chat template: one that mentions ``<tool_call>`` is Hermes, one
that mentions ``<|python_tag|>`` is Llama 3; anything else gets Hermes.
"""

from __future__ import annotations

from .base import ParsedCall, ParsedOutput, ToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .streaming import StreamedCall, ToolCallStream

PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
CHOICES = ("auto", *PARSERS)

__all__ = [
    "CHOICES",
    "PARSERS",
    "ParsedCall",
    "ParsedOutput",
    "StreamedCall",
    "ToolCallStream",
    "ToolParser",
    "pick_parser",
]


def pick_parser(name: str, chat_template: str | None) -> ToolParser:
    """The parser called ``name``; for ``"auto"``, the one ``chat_template`` suggests."""
    if name != "auto":
        return PARSERS[name]()
    template = chat_template or ""
    if "<tool_call>" not in template and "<|python_tag|>" in template:
        return Llama3JsonToolParser()
    return HermesToolParser()
