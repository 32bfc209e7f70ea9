"""What vLLM's clients send and read, through the official ``openai`` client, on both backends.

``chat_template_kwargs``; tool, ``response_format`` and ``structured_outputs`` schemas with
``$defs``; objects closed to unnamed properties by default (and open with
``allow_additional_properties``); ``iteration_tokens_total`` as vLLM counts it; strict
types where bool and int compare equal; the OpenAPI schema open and exact. A refused
request must change nothing on the engine: no step, no token, no request admitted.
"""

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
from tgengine import Engine

from model_factory import CHAT_TEMPLATE

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "Hello"}]
THINKING_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<|im_start|>system\\nno thinking<|im_end|>\\n' }}{% endif %}"
    "{% if note is defined %}{{ note + '\\n' }}{% endif %}" + CHAT_TEMPLATE
)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def admitted(engine: Engine) -> tuple[Any, ...]:
    """What any admitted request would change: steps, tokens, finished and live requests."""
    stats = engine.stats()
    return (
        stats.num_steps,
        stats.prompt_tokens_total,
        stats.generation_tokens_total,
        dict(stats.finished_total),
        stats.num_running,
        stats.num_waiting,
    )


# -- chat_template_kwargs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that reads ``enable_thinking`` and a ``note``."""
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


async def test_chat_template_kwargs_reach_the_template(thinking_dir: Path) -> None:
    kwargs = {"enable_thinking": False, "note": "Paris is the capital"}  # note: unknown to us
    bad_values: list[Any] = [["enable_thinking"], "enable_thinking=false", {"tokenize": False}]
    with anyio.fail_after(TIMEOUT):
        async with running_server(thinking_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                plain = await client.chat.completions.create(
                    model=MODEL,
                    messages=HELLO,  # type: ignore[arg-type]
                    max_tokens=1,
                )
                shaped = await client.chat.completions.create(
                    model=MODEL,
                    messages=HELLO,  # type: ignore[arg-type]
                    max_tokens=1,
                    extra_body={"chat_template_kwargs": kwargs},
                )
                before = admitted(running.engine)
                refused = []
                for bad in bad_values:
                    with pytest.raises(openai.BadRequestError) as error:
                        await client.chat.completions.create(
                            model=MODEL,
                            messages=HELLO,  # type: ignore[arg-type]
                            max_tokens=1,
                            extra_body={"chat_template_kwargs": bad},
                        )
                    refused.append(error.value)
                after = admitted(running.engine)
            tokenizer = running.engine.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    turn = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    thinking_off = "<|im_start|>system\nno thinking<|im_end|>\n"
    assert plain.usage is not None and shaped.usage is not None
    assert plain.usage.prompt_tokens == count(turn)
    assert shaped.usage.prompt_tokens == count(thinking_off + "Paris is the capital\n" + turn)
    assert [(e.status_code, e.param) for e in refused] == [(400, "chat_template_kwargs")] * 3
    assert after == before


# -- $defs ------------------------------------------------------------------------------------


def with_options(options: dict[str, Any]) -> dict[str, Any]:
    """Parameters whose ``options`` is a ``$ref`` to their own ``$defs/Options``."""
    return {
        "type": "object",
        "properties": {"options": {"$ref": "#/$defs/Options"}},
        "required": ["options"],
        "$defs": {"Options": options},
    }


# two tools, each its own "Options": they must not clash
UNIT = with_options(
    {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
)
COUNT = with_options(
    {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["count"],
    }
)
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": UNIT}},
    {"type": "function", "function": {"name": "count", "parameters": COUNT}},
]
PARAMETERS = {"weather": UNIT, "count": COUNT}


async def test_schemas_keep_their_defs(tiny_llama_dir: Path) -> None:
    chat: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 200, "seed": 3}
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                required = await client.chat.completions.create(
                    **chat, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
                )
                named = [
                    await client.chat.completions.create(
                        **chat,
                        tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": name}},
                    )
                    for name in PARAMETERS
                ]
                formatted = await client.chat.completions.create(
                    **chat,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "count", "schema": COUNT},
                    },
                )
                extra = await client.completions.create(
                    model=MODEL,
                    prompt="Hello",
                    max_tokens=200,
                    extra_body={"structured_outputs": {"json": UNIT}},
                )

    calls = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    function = calls[0].function  # type: ignore[union-attr]
    jsonschema.validate(json.loads(function.arguments), PARAMETERS[function.name])
    for name, response in zip(PARAMETERS, named, strict=True):
        (call,) = response.choices[0].message.tool_calls or []
        assert call.function.name == name  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[name])  # type: ignore[union-attr]
    jsonschema.validate(json.loads(formatted.choices[0].message.content or ""), COUNT)
    jsonschema.validate(json.loads(extra.choices[0].text), UNIT)


# -- closed objects -------------------------------------------------------------------------

OPEN_RESULT = {
    "type": "object",
    "properties": {"result": {"type": "integer", "minimum": 0, "maximum": 99}},
}
# satisfiable only with a property the schema does not name
NEEDS_ANOTHER = {**OPEN_RESULT, "required": ["result", "other"]}
# the same, saying what other properties may be (bounded, so a random model finishes it)
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SAYS_SO = {**NEEDS_ANOTHER, "additionalProperties": DIGIT, "maxProperties": 2}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def test_objects_take_only_the_properties_they_name(tiny_llama_dir: Path) -> None:
    chat: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 60}
    closed_tool = [{"type": "function", "function": {"name": "f", "parameters": NEEDS_ANOTHER}}]
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                sampled = await client.chat.completions.create(
                    **chat, n=4, seed=1, response_format=json_schema_format(OPEN_RESULT)
                )
                said_so = await client.chat.completions.create(
                    **chat, temperature=0, response_format=json_schema_format(SAYS_SO)
                )
                before = admitted(running.engine)
                refused = []
                for fields in (
                    {"response_format": json_schema_format(NEEDS_ANOTHER)},
                    {"extra_body": {"structured_outputs": {"json": NEEDS_ANOTHER}}},
                    {"tools": closed_tool, "tool_choice": "required"},
                ):
                    with pytest.raises(openai.BadRequestError) as error:
                        await client.chat.completions.create(**chat, **fields)
                    refused.append(error.value)
                after = admitted(running.engine)
        async with running_server(
            tiny_llama_dir, api_key=API_KEY, allow_additional_properties=True
        ) as running:
            async with async_client(running.url) as client:
                lenient = await client.chat.completions.create(
                    **chat, temperature=0, response_format=json_schema_format(NEEDS_ANOTHER)
                )

    for choice in sampled.choices:
        assert set(json.loads(choice.message.content or "")) <= {"result"}, choice.message
    jsonschema.validate(json.loads(said_so.choices[0].message.content or ""), SAYS_SO)
    assert [e.param for e in refused] == ["response_format", "structured_outputs", "tool_choice"]
    assert all("other" in e.message and e.status_code == 400 for e in refused), refused
    assert after == before
    # lenient: it compiles, and the answer starts as the schema says ("other" may be any
    # JSON value, which a random model need not finish within max_tokens)
    answer = lenient.choices[0]
    assert (answer.message.content or "").startswith('{"result":'), answer
    if answer.finish_reason == "stop":
        assert "other" in json.loads(answer.message.content or "")


# -- iteration_tokens_total -------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(f"{name}{{")]
    return float(line.rsplit(" ", 1)[1])


async def test_iteration_tokens_count_prompt_and_max_tokens(tiny_llama_dir: Path) -> None:
    """vLLM: each iteration with outputs observes its prompt (at a request's first token)
    plus generated tokens, so one request sums to prompt + max_tokens over max_tokens
    iterations; a batch of n=2 counts each sequence's prompt."""
    prompt = list(range(3, 30))
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
                )
                async with running.client() as http:
                    one = (await http.get("/metrics")).text
                await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=4, n=2, extra_body={"ignore_eos": True}
                )
                async with running.client() as http:
                    two = (await http.get("/metrics")).text

    assert metric(one, "tgengine:iteration_tokens_total_sum") == len(prompt) + 5
    assert metric(one, "tgengine:iteration_tokens_total_count") == 5
    total = len(prompt) + 5 + 2 * (len(prompt) + 4)
    assert metric(two, "tgengine:iteration_tokens_total_sum") == total


# -- strict types and the schema ------------------------------------------------------------


async def test_bools_are_not_ints_and_the_schema_is_open_and_exact(tiny_llama_dir: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"echo": 0}, "echo"),
        ({"echo": 1}, "echo"),
        ({"n": True}, "n"),
        ({"best_of": True}, "best_of"),
        ({"n": 1.0}, "n"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
    ]
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            before = admitted(running.engine)
            refused = []
            async with async_client(running.url) as client:
                for fields, _ in cases:
                    with pytest.raises(openai.BadRequestError) as error:
                        await client.completions.create(
                            model=MODEL, prompt="Hello", max_tokens=2, extra_body=fields
                        )
                    refused.append(error.value.param)
                with pytest.raises(openai.BadRequestError) as empty:
                    await client.completions.create(model=MODEL, prompt="", max_tokens=2)
            after = admitted(running.engine)
            async with running.client() as anonymous:  # no key: open, as in vLLM
                schema = await anonymous.get("/openapi.json")
                docs = await anonymous.get("/docs")
                models = await anonymous.get("/v1/models")

    assert refused == [param for _, param in cases]
    assert empty.value.param == "prompt"
    assert after == before
    assert schema.status_code == 200 and docs.status_code == 200
    assert models.status_code == 401  # the API itself still needs the key
    request = schema.json()["components"]["schemas"]["CompletionRequest"]["properties"]
    prompt_text, _, prompt_batch, _ = request["prompt"]["anyOf"]
    assert prompt_text == {"type": "string", "minLength": 1}
    assert prompt_batch["items"] == {"type": "string", "minLength": 1}
    stop_text, stop_list, _ = request["stop"]["anyOf"]
    assert stop_text["minLength"] == 1 and stop_list["items"]["minLength"] == 1
    seed = request["seed"]["anyOf"][0]
    assert seed["maximum"] == 2**63 - 1 and isinstance(seed["maximum"], int)
    assert seed["minimum"] == -(2**63) and isinstance(seed["minimum"], int)
    assert '"maximum":9223372036854775807' in schema.text.replace(" ", "")
