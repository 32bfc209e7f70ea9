"""The server driven by the official ``openai`` client (async and sync), on both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from server_helpers import API_KEY, MODEL, TIMEOUT, assert_error_body, running_server
from tgengine import SamplingParams

pytestmark = pytest.mark.anyio

CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Hello, how are you today?"},
]
GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


async def test_async_client_streamed_text_equals_whole_text(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with async_client(running.url) as client:
                whole = await client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
                stream = await client.completions.create(
                    model=MODEL,
                    prompt="Hello",
                    stream=True,
                    stream_options={"include_usage": True},
                    **GREEDY,
                )
                pieces, reasons, usage = [], [], None
                async for chunk in stream:
                    for choice in chunk.choices:
                        pieces.append(choice.text)
                        reasons.append(choice.finish_reason)
                    usage = chunk.usage or usage

                chat_whole = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    **GREEDY,
                )
                chat_stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    stream=True,
                    **GREEDY,
                )
                chat_pieces, roles = [], []
                async for chat_chunk in chat_stream:
                    delta = chat_chunk.choices[0].delta
                    roles.append(delta.role)
                    chat_pieces.append(delta.content or "")

            library = [c async for c in running.engine.generate("Hello", _greedy(12))]

    text = whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert "".join(pieces) == text == "".join(c.text for c in library)
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert "".join(chat_pieces) == chat_whole.choices[0].message.content
    assert chat_whole.choices[0].finish_reason == "length"
    assert chat_whole.usage is not None and chat_whole.usage.completion_tokens == 12
    assert roles[0] == "assistant"


async def test_sync_client_streamed_text_equals_whole_text(tiny_llama_dir: Path) -> None:
    def drive(url: str) -> dict[str, Any]:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
            whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], **GREEDY)
            streamed = "".join(
                chunk.choices[0].text
                for chunk in client.completions.create(
                    model=MODEL, prompt=[5, 6, 7], stream=True, **GREEDY
                )
            )
            chat = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)  # type: ignore[arg-type]
            chat_streamed = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    stream=True,
                    **GREEDY,
                )
            )
            models = [m.id for m in client.models.list()]
        return {
            "text": whole.choices[0].text,
            "streamed": streamed,
            "chat": chat.choices[0].message.content,
            "chat_streamed": chat_streamed,
            "models": models,
        }

    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            result = await anyio.to_thread.run_sync(drive, running.url)
    assert result["streamed"] == result["text"] != ""
    assert result["chat_streamed"] == result["chat"] != ""
    assert result["models"] == [MODEL]


async def test_logprobs_seed_stop_and_max_completion_tokens(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir) as running:
            async with async_client(running.url) as client:
                scored = await client.completions.create(
                    model=MODEL, prompt="Hello", logprobs=0, **GREEDY
                )
                chat = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    logprobs=True,
                    max_completion_tokens=5,
                    temperature=0,
                )
                seeded = [
                    (
                        await client.completions.create(
                            model=MODEL, prompt="Hello", max_tokens=10, temperature=1.0, seed=7
                        )
                    )
                    .choices[0]
                    .text
                    for _ in range(2)
                ]
                text = scored.choices[0].text
                stop = text[3:6] if text[3:6].strip() else text[2:4]
                stopped = await client.completions.create(
                    model=MODEL, prompt="Hello", stop=[stop], **GREEDY
                )
                models = await client.models.list()
                card = await client.models.retrieve(MODEL)
                with pytest.raises(openai.NotFoundError) as missing:
                    await client.models.retrieve("no-such-model")

    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 12 and all(v <= 0 for v in logprobs.token_logprobs)
    assert chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content or []
    assert len(content) == 5 and chat.usage is not None and chat.usage.completion_tokens == 5
    assert seeded[0] == seeded[1]
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text and text.startswith(stopped.choices[0].text)
    assert [m.id for m in models.data] == [MODEL] and card.id == MODEL
    assert missing.value.status_code == 404


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def test_invalid_requests_are_400s_naming_the_field(tiny_llama_dir: Path) -> None:
    long_prompt = list(range(3, 300)) * 2  # longer than the tiny model's 512 positions
    cases: list[tuple[str, dict[str, Any], str | None]] = [
        ("/v1/completions", {"prompt": long_prompt}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi " * 600}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 65}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 600},
            "max_completion_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias.1"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "yaml"}},
            "response_format.type",
        ),
        ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": [1, -5]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
    ]
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, max_body_bytes=4096) as running:
            async with running.client() as http:
                for path, fields, param in cases:
                    response = await http.post(path, json={"model": MODEL, **fields})
                    error = assert_error_body(response, 400)
                    assert error["param"] == param, (fields, error)
                too_big = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "a" * 5000}
                )
                assert assert_error_body(too_big, 413)["code"] == "request_too_large"
            async with async_client(running.url) as client:
                with pytest.raises(openai.BadRequestError) as bad:
                    await client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
