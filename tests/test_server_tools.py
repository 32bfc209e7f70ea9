"""Tool calling on chat through the ``openai`` client: every ``tool_choice``, streamed and
whole, the Hermes and Llama 3 formats, tool messages back into the template, bad choices."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from server_helpers import API_KEY, MODEL, TIMEOUT, running_server
from tgengine.server.protocol import ChatMessage
from tgengine.server.tools import template_messages
from tgengine.tokenization.tokenizer import chat_prompt, load_tokenizer

from model_factory import read_config, write_config

pytestmark = pytest.mark.anyio

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": CITY, "get_time": ZONE}
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": p}}
    for name, p in PARAMETERS.items()
]
CHAT: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_ANSWER = (
    'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    "\n</tool_call>"
)
LLAMA3_ANSWER = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'
# A Hermes-style template that renders tools, assistant tool calls and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tool_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tool-model") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    config = read_config(path)
    config["max_position_embeddings"] = 2048  # tools make long prompts (byte-level BPE)
    write_config(path, config)
    return path


async def ask(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The whole answer, and the streamed one reassembled from its deltas."""
    whole = await client.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kwargs)
    content, calls, reason = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or "" if delta.function else ""
                call["arguments"] += delta.function.arguments or "" if delta.function else ""
    streamed = {"content": content, "calls": [calls[i] for i in sorted(calls)], "reason": reason}
    return whole.choices[0], streamed


def whole_calls(choice: Any) -> list[dict[str, str]]:
    return [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or []
    ]


def check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


async def test_required_and_named_choices_are_enforced(tool_model_dir: Path) -> None:
    """A model never trained for tools returns valid calls: the choice is a constraint."""
    sampled = {"max_tokens": 300, "temperature": 1.0, "seed": 3}
    with anyio.fail_after(TIMEOUT):
        async with running_server(tool_model_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                required = await ask(client, tools=TOOLS, tool_choice="required", **sampled)
                single = await ask(
                    client,
                    tools=TOOLS,
                    tool_choice="required",
                    parallel_tool_calls=False,
                    **sampled,
                )
                named_choice: Any = {"type": "function", "function": {"name": "get_weather"}}
                named = await ask(client, tools=TOOLS, tool_choice=named_choice, **sampled)
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,
                    tools=TOOLS,
                    tool_choice=named_choice,
                    n=2,
                    stream=True,
                    **sampled,
                )
                ids = {
                    (choice.index, delta.id)
                    async for chunk in stream
                    for choice in chunk.choices
                    for delta in choice.delta.tool_calls or []
                    if delta.id
                }
    for whole, streamed in (required, single):
        assert whole.finish_reason == streamed["reason"] == "tool_calls"
        assert whole.message.content is None and streamed["content"] == ""
        check_calls(whole_calls(whole))
        check_calls(streamed["calls"])
        assert all(c["id"].startswith("call_") for c in streamed["calls"])
    assert len(whole_calls(single[0])) == len(single[1]["calls"]) == 1
    whole, streamed = named
    assert whole.finish_reason == streamed["reason"] == "stop"  # as OpenAI, for a named choice
    assert [c["name"] for c in whole_calls(whole)] == ["get_weather"]
    assert [c["name"] for c in streamed["calls"]] == ["get_weather"]
    check_calls(whole_calls(whole))
    check_calls(streamed["calls"])
    assert len(streamed["calls"]) == 1
    assert {index for index, _ in ids} == {0, 1} and len({i for _, i in ids}) == 2


@pytest.mark.parametrize(
    ("parser", "answer", "content", "call"),
    [
        (
            "auto",
            HERMES_ANSWER,
            "Checking.",
            {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
        ),
        ("llama3_json", LLAMA3_ANSWER, None, {"name": "get_time", "arguments": {"tz": "UTC"}}),
    ],
)
async def test_auto_parses_the_model_format(
    tool_model_dir: Path, parser: str, answer: str, content: str | None, call: dict[str, Any]
) -> None:
    """``auto`` reads the model's own format; the answer is forced here with a choice."""
    forced = {
        "max_tokens": 120,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"choice": [answer]}},
    }
    with anyio.fail_after(TIMEOUT):
        async with running_server(
            tool_model_dir, api_key=API_KEY, tool_call_parser=parser
        ) as running:
            async with async_client(running.url) as client:
                whole, streamed = await ask(client, tools=TOOLS, tool_choice="auto", **forced)
                plain, _ = await ask(client, tools=TOOLS, tool_choice="none", **forced)
    assert whole.finish_reason == streamed["reason"] == "tool_calls"
    assert whole.message.content == content and streamed["content"] == (content or "")
    for calls in (whole_calls(whole), streamed["calls"]):
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (call["name"], call["arguments"])
        ]
    assert plain.finish_reason == "stop" and plain.message.content == answer
    assert not plain.message.tool_calls


async def test_tools_and_tool_messages_reach_the_template(tool_model_dir: Path) -> None:
    messages = [
        ChatMessage(role="user", content="Weather in Rome?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="sunny, 25 C", tool_call_id="call_1"),
    ]
    tokenizer = load_tokenizer(str(tool_model_dir))
    text = tokenizer.decode(chat_prompt(tokenizer, template_messages(messages), TOOLS))
    assert '"name": "get_time"' in text and "get_time tool" in text  # the tools
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "sunny, 25 C [call_1]" in text
    with anyio.fail_after(TIMEOUT):
        async with running_server(tool_model_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                wire = [m.model_dump(exclude_none=True) for m in messages]
                response = await client.chat.completions.create(
                    model=MODEL,
                    messages=wire,
                    tools=TOOLS,
                    tool_choice="none",
                    max_tokens=4,  # type: ignore[arg-type]
                )
                without = await client.chat.completions.create(
                    model=MODEL,
                    messages=wire,
                    max_tokens=4,  # type: ignore[arg-type]
                )
    assert response.usage is not None and without.usage is not None
    assert response.usage.prompt_tokens > without.usage.prompt_tokens  # the tools were rendered


async def test_bad_tool_choices_are_400s(tool_model_dir: Path) -> None:
    unknown: Any = {"type": "function", "function": {"name": "nope"}}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": unknown}, "no tool is named 'nope'"),
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objekt"}},
                    }
                ],
                "tool_choice": "required",
            },
            "objekt",
        ),
    ]
    with anyio.fail_after(TIMEOUT):
        async with running_server(tool_model_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                bodies = []
                for kwargs, _ in bad:
                    with pytest.raises(openai.BadRequestError) as e:
                        await client.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
                    bodies.append(e.value.body)
    for (_, reason), body in zip(bad, bodies, strict=True):
        assert isinstance(body, dict) and body["param"] == "tool_choice", body
        assert reason in body["message"], body
