"""Each server-sent event stays on one line for every client, whatever text it carries."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder
from hypothesis import given
from hypothesis import strategies as st

from tgengine.server.generation import sse_event
from tgengine.server.protocol import CompletionChoice, CompletionResponse


def completion_chunk(text: str) -> CompletionResponse:
    choice = CompletionChoice(index=0, text=text, finish_reason=None)
    return CompletionResponse(id="cmpl-1", created=0, model="m", choices=[choice])


@given(st.text())
def test_an_event_is_one_line_even_for_python_splitlines(text: str) -> None:
    # httpx's aiter_lines splits like str.splitlines: at U+2028, U+0085 and friends too.
    lines = LineDecoder().decode(sse_event(completion_chunk(text)).decode())
    assert lines[0].startswith("data: ")
    assert lines[1:] == [""], "the event broke into several lines"
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["text"] == text


def test_line_separators_inside_text_survive() -> None:
    text = "a\u2028b\u2029c\x85d\ne\rf"
    event = sse_event(completion_chunk(text)).decode()
    assert event.splitlines()[1:] == [""]
    assert json.loads(event.splitlines()[0][len("data: ") :])["choices"][0]["text"] == text
