"""n, prompt batches, logprobs, echo, penalties and validation through the ``openai`` client."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from server_helpers import API_KEY, MODEL, TIMEOUT, running_server

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "Tell me a story."}]
SAMPLED: dict[str, Any] = {
    "max_tokens": 6,
    "temperature": 1.0,
    "seed": 5,
    "extra_body": {"ignore_eos": True},
}


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


async def test_n_and_prompt_batches_streamed_and_whole(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with client_for(running.url) as client:
                whole = await client.completions.create(model=MODEL, prompt="Once", n=3, **SAMPLED)
                stream = await client.completions.create(
                    model=MODEL,
                    prompt="Once",
                    n=3,
                    stream=True,
                    stream_options={"include_usage": True},
                    **SAMPLED,
                )
                streamed: dict[int, str] = defaultdict(str)
                finished: dict[int, str | None] = {}
                stream_usage = None
                async for chunk in stream:
                    for choice in chunk.choices:
                        streamed[choice.index] += choice.text
                        if choice.finish_reason:
                            finished[choice.index] = choice.finish_reason
                    stream_usage = chunk.usage or stream_usage
                batch = await client.completions.create(
                    model=MODEL, prompt=["Once", "Upon a time"], n=2, **SAMPLED
                )
                ids_batch = await client.completions.create(
                    model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0
                )
                chat = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    n=2,
                    **SAMPLED,
                )
                chat_stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    n=2,
                    stream=True,
                    **SAMPLED,
                )
                chat_streamed: dict[int, str] = defaultdict(str)
                async for chat_chunk in chat_stream:
                    for chat_choice in chat_chunk.choices:
                        chat_streamed[chat_choice.index] += chat_choice.delta.content or ""
            stats = running.engine.stats()
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1
    assert dict(streamed) == dict(enumerate(texts))  # seeded: the same samples streamed
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    assert stream_usage is not None and stream_usage.completion_tokens == 18
    assert stream_usage.prompt_tokens == whole.usage.prompt_tokens
    # prompt p, sequence i is choice p * n + i; the first prompt's choices equal the n=2 run
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices[:2]] == texts[:2]
    assert batch.usage is not None and batch.usage.completion_tokens == 24
    assert ids_batch.usage is not None and ids_batch.usage.prompt_tokens == 5
    assert [c.message.content for c in chat.choices] == [chat_streamed[0], chat_streamed[1]]
    assert stats.prefix_cache_hits_total > 0  # the n sequences shared their prompt


async def test_logprobs_echo_and_biases(tiny_llama_dir: Path) -> None:
    repeats = [7] * 20
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir) as running:
            async with client_for(running.url) as client:
                scored = await client.completions.create(
                    model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, logprobs=3
                )
                zero = await client.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=2, logprobs=0
                )
                echoed = await client.completions.create(
                    model=MODEL,
                    prompt="Hello there",
                    max_tokens=3,
                    temperature=0,
                    echo=True,
                    logprobs=1,
                )
                echo_stream = await client.completions.create(
                    model=MODEL,
                    prompt="Hello there",
                    max_tokens=3,
                    temperature=0,
                    echo=True,
                    stream=True,
                )
                echo_streamed = "".join([c.choices[0].text async for c in echo_stream])
                chat = await client.chat.completions.create(
                    model=MODEL,
                    messages=CHAT,  # type: ignore[arg-type]
                    max_tokens=3,
                    logprobs=True,
                    top_logprobs=2,
                    response_format={"type": "text"},
                    seed=-(2**63),
                )
                biased = await client.completions.create(
                    model=MODEL, prompt=repeats, max_tokens=4, temperature=0, logit_bias={"77": 100}
                )
                free = await client.completions.create(
                    model=MODEL, prompt=repeats, max_tokens=20, temperature=0
                )
                penalised = await client.completions.create(
                    model=MODEL,
                    prompt=repeats,
                    max_tokens=20,
                    temperature=0,
                    frequency_penalty=2.0,
                    presence_penalty=1.0,
                    extra_body={"repetition_penalty": 1.5, "min_tokens": 2},
                )
                with pytest.raises(openai.BadRequestError) as too_long:
                    await client.completions.create(model=MODEL, prompt="Hi", max_tokens=5000)
            tokenizer = running.engine.tokenizer
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == scored.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) in (3, 4) and top[token] == value and max(top.values()) == value
    zlp = zero.choices[0].logprobs
    assert zlp is not None and zlp.top_logprobs is not None
    assert [len(top) for top in zlp.top_logprobs] == [1, 1]  # just the sampled token
    elp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("Hello there")
    assert echo_streamed == echoed.choices[0].text
    num_prompt = len(tokenizer.encode("Hello there"))
    assert elp is not None and elp.token_logprobs is not None and elp.top_logprobs is not None
    assert len(elp.token_logprobs) == num_prompt + 3
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    content = (chat.choices[0].logprobs and chat.choices[0].logprobs.content) or []
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert biased.choices[0].text == tokenizer.decode([77] * 4)
    assert penalised.choices[0].text != free.choices[0].text
    message = str(too_long.value)
    assert "max_tokens" in message and "5000" in message and "512" in message
