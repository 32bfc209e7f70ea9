"""Structured outputs on the OpenAI API: response_format and vLLM's structured_outputs,
streamed and whole, validated over many random schemas and seeds; bad constraints are 400s."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import openai
import pytest

from server_helpers import API_KEY, MODEL, TIMEOUT, running_server

from structured_helpers import CASES, PERSON, check_output, random_schema

pytestmark = pytest.mark.anyio
# Any JSON object has unbounded strings, which a random model rarely ends; greedy, this
# (deterministic) tiny model answers this message with a short object.
CHAT: Any = [{"role": "user", "content": "Give me JSON."}]
# Many schemas x seeds in CI; TGENGINE_SCHEMA_CASES=500 for a longer hunt.
NUM_SCHEMAS = int(os.environ.get("TGENGINE_SCHEMA_CASES", "24"))


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


async def chat_stream_text(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kwargs)
    pieces, reason = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(pieces), reason


async def test_response_format_streamed_and_whole(tiny_llama_dir: Path) -> None:
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                results = {}
                for name, fmt in (
                    ("json", schema_format),
                    ("json_object", {"type": "json_object"}),
                ):
                    options: dict[str, Any] = {"max_tokens": 200, "temperature": 0, "seed": 1}
                    whole = await client.chat.completions.create(
                        model=MODEL, messages=CHAT, response_format=fmt, **options
                    )
                    streamed = await chat_stream_text(client, response_format=fmt, **options)
                    results[name] = (whole.choices[0], streamed)
    for name, (whole, (streamed_text, streamed_reason)) in results.items():
        assert whole.finish_reason == streamed_reason == "stop"
        assert whole.message.content == streamed_text
        check_output(name, streamed_text)


async def test_structured_outputs_extra_body_on_both_endpoints(tiny_llama_dir: Path) -> None:
    kinds = ("regex", "choice", "grammar", "json")
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                texts: list[tuple[str, str, str | None]] = []
                for kind in kinds:
                    extra = {"structured_outputs": CASES[kind]}
                    options: dict[str, Any] = {"max_tokens": 200, "temperature": 1.0}
                    completion = await client.completions.create(
                        model=MODEL, prompt="Hello", extra_body=extra, **options
                    )
                    texts.append(
                        (kind, completion.choices[0].text, completion.choices[0].finish_reason)
                    )
                    streamed, reason = await chat_stream_text(client, extra_body=extra, **options)
                    texts.append((kind, streamed, reason))
                    pieces = []
                    stream = await client.completions.create(
                        model=MODEL, prompt="Hi", extra_body=extra, stream=True, **options
                    )
                    async for chunk in stream:
                        pieces += [choice.text for choice in chunk.choices]
                        reason = chunk.choices[0].finish_reason if chunk.choices else reason
                    texts.append((kind, "".join(pieces), reason))
    for kind, text, reason in texts:
        assert reason == "stop", (kind, text)
        check_output(kind, text)


async def test_many_random_schemas_and_seeds_validate(tiny_llama_dir: Path) -> None:
    """Random schemas, sampled at temperature 1 with several seeds, all at once."""
    rng = random.Random(2024)
    cases = [(random_schema(rng), seed) for seed in range(2) for _ in range(NUM_SCHEMAS // 2)]
    answers: list[tuple[dict[str, Any], str, str | None]] = []

    async def ask(client: openai.AsyncOpenAI, schema: dict[str, Any], seed: int) -> None:
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        response = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format=fmt,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
        )
        choice = response.choices[0]
        answers.append((schema, choice.message.content or "", choice.finish_reason))

    with anyio.fail_after(TIMEOUT * 2):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client, anyio.create_task_group() as tg:
                for schema, seed in cases:
                    tg.start_soon(ask, client, schema, seed)
    assert len(answers) == len(cases)
    for schema, text, reason in answers:
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


async def test_bad_constraints_are_400s_with_the_reason(tiny_llama_dir: Path) -> None:
    bad: list[tuple[dict[str, Any], str, str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "objekt",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "(("}}},
            "structured_outputs",
            "unclosed group",
        ),
        (
            {"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}},
            "structured_outputs",
            "nowhere",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {
                "extra_body": {"structured_outputs": {"choice": ["a"]}},
                "response_format": {"type": "json_object"},
            },
            "structured_outputs",
            "not both",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ]
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                errors = []
                for kwargs, _, _ in bad:
                    with pytest.raises(openai.BadRequestError) as e:
                        await client.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
                    errors.append(e.value.body)
                for stream in (False, True):
                    with pytest.raises(openai.BadRequestError):
                        await client.completions.create(
                            model=MODEL,
                            prompt="x",
                            stream=stream,
                            extra_body=bad[1][0]["extra_body"],
                        )
                assert running.engine.stats().num_waiting == 0
    for (_, param, reason), body in zip(bad, errors, strict=True):
        assert isinstance(body, dict)
        assert body["param"] == param and reason in body["message"], body
