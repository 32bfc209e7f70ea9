"""Tool-call formats: whole answers and the same answers streamed in any pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tgengine.server.tool_parsers import ParsedCall, ToolCallStream, pick_parser

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
TIME = ParsedCall("get_time", "{}")
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)
# (parser, answer, content, calls)
CASES = [
    ("hermes", HERMES, "Let me check.\n", [WEATHER, TIME]),
    (
        "hermes",
        "No call, just a <tool and a <tool_cal",
        "No call, just a <tool and a <tool_cal",
        [],
    ),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", LLAMA3, "", [WEATHER, TIME]),
    ("llama3_json", ' {"name": "get_time", "parameters": {}}', "", [TIME]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", 'Text first {"name": "get_time"}', 'Text first {"name": "get_time"}', []),
]


@pytest.mark.parametrize(("name", "answer", "content", "calls"), CASES)
def test_whole_answer(name: str, answer: str, content: str, calls: list[ParsedCall]) -> None:
    parsed = pick_parser(name, None).parse(answer)
    assert (parsed.content, parsed.calls) == (content, calls)


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(1, 6), min_size=1, max_size=60))
def test_streamed_in_any_pieces_equals_whole(
    case: tuple[str, str, str, list[ParsedCall]], cuts: list[int]
) -> None:
    name, answer, content, calls = case
    stream = ToolCallStream(pick_parser(name, None))
    got_content, got_calls, pos = "", [], 0
    for cut in cuts * (len(answer) // sum(cuts) + 1):
        if pos >= len(answer):
            break
        piece = stream.feed(answer[pos : pos + cut])
        pos += cut
        got_content += piece.content
        got_calls += piece.calls
    end = stream.finish()
    assert (got_content + end.content, got_calls + end.calls) == (content, calls)


def test_hermes_streams_each_call_once_it_closes() -> None:
    stream = ToolCallStream(pick_parser("hermes", None))
    first_call_end = HERMES.index("</tool_call>") + len("</tool_call>")
    piece = stream.feed(HERMES[:first_call_end])
    assert piece.content == "Let me check.\n" and piece.calls == [WEATHER]
    assert stream.feed(HERMES[first_call_end:]).calls == [TIME]
    assert stream.finish().calls == []


def test_parser_is_picked_by_the_chat_template() -> None:
    assert pick_parser("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert pick_parser("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert pick_parser("auto", None).name == "hermes"
    assert pick_parser("llama3_json", "<tool_call>").name == "llama3_json"
    assert json.loads(WEATHER.arguments) == {"city": "Paris"}


def test_server_config_names_every_parser() -> None:
    from tgengine.server.config import TOOL_CALL_PARSERS
    from tgengine.server.tool_parsers import CHOICES

    assert TOOL_CALL_PARSERS == CHOICES
