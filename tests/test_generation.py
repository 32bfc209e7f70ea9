"""Sampling, stopping, streaming text and bad input, through the public Engine API."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import Engine, InvalidRequestError, SamplingParams, open_engine

from engine_helpers import TIMEOUT, Consumer, collect, generate_all, greedy, tiny_config, tokens_of

pytestmark = pytest.mark.anyio
PROMPT = "The quick brown fox jumps over the lazy dog."


async def test_seeded_sampling_reproduces_in_any_batch(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            alone = tokens_of(await collect(engine, PROMPT, params))
            crowd = await generate_all(
                engine,
                [[5, 6, 7], [9] * 20, engine.tokenizer.encode(PROMPT), [11, 12]],
                SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True),
            )
            unseeded = [tokens_of(await collect(engine, PROMPT, others)) for _ in range(3)]
    assert tokens_of(crowd[2]) == alone
    assert len({tuple(t) for t in unseeded}) > 1, "unseeded sampling should vary"


async def test_top_k_1_is_greedy_and_logprobs(tiny_qwen2_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_qwen2_dir)) as engine:
            want = tokens_of(await collect(engine, PROMPT, greedy(12)))
            params = SamplingParams(
                max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True, logprobs=True
            )
            chunks = await collect(engine, PROMPT, params)
    assert tokens_of(chunks) == want
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    assert len(logprobs) == 12 and all(lp <= 0.0 for lp in logprobs)


async def test_max_tokens_ends_with_length(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            chunks = await collect(engine, PROMPT, greedy(7))
    assert len(tokens_of(chunks)) == 7
    assert [c.finish_reason for c in chunks] == [None] * 6 + ["length"]


async def test_stop_token_ids_end_with_stop(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            free = tokens_of(await collect(engine, PROMPT, greedy(20)))
            stop_at = next(i for i, t in enumerate(free) if free.index(t) == i and i >= 3)
            params = SamplingParams(
                max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=(free[stop_at],)
            )
            chunks = await collect(engine, PROMPT, params)
    assert tokens_of(chunks) == free[: stop_at + 1]
    assert chunks[-1].finish_reason == "stop"


async def test_stop_string_is_never_emitted(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            full = "".join(c.text for c in await collect(engine, PROMPT, greedy(40)))
            stop = full[len(full) // 2 : len(full) // 2 + 3]
            assert stop.strip(), f"pick a visible stop string from {full!r}"
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
            chunks = await collect(engine, PROMPT, params)
    text = "".join(c.text for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop"


async def test_streamed_text_equals_decode(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            chunks = await collect(engine, "héllo wörld ✓ 你好", greedy(48))
            decoded = engine.tokenizer.decode(tokens_of(chunks), skip_special_tokens=True)
    assert "".join(c.text for c in chunks) == decoded


async def test_breaking_out_aborts_and_frees_blocks(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            total = engine.stats().num_total_blocks
            async for _chunk in engine.generate(PROMPT, greedy(400)):
                break
            stats = engine.stats()
            assert stats.num_running + stats.num_waiting == 0
            assert stats.num_free_blocks == total
            assert stats.finished_total.get("abort") == 1


async def test_abort_by_id_ends_with_abort(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            chunks = []
            async for chunk in engine.generate(PROMPT, greedy(400), request_id="r1"):
                chunks.append(chunk)
                if len(chunks) == 2:
                    engine.abort("r1")
    assert [c.finish_reason for c in chunks] == [None, None, "abort"]


BAD_INPUT = [
    ("prompt", "", {}),
    ("prompt", [], {}),
    ("prompt", "x " * 600, {}),
    ("max_tokens", PROMPT, {"max_tokens": -1}),
    ("temperature", PROMPT, {"temperature": -0.5}),
    ("top_p", PROMPT, {"top_p": 0.0}),
    ("top_p", PROMPT, {"top_p": 1.5}),
]


@pytest.mark.parametrize(("field", "prompt", "overrides"), BAD_INPUT)
async def test_bad_input_is_refused_and_others_keep_running(
    tiny_llama_dir: Path, field: str, prompt: str | list[int], overrides: dict[str, float]
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            other = Consumer(engine, PROMPT, greedy(30))
            async with anyio.create_task_group() as tg:
                tg.start_soon(other.run)
                await other.first_chunk.wait()
                with pytest.raises(InvalidRequestError) as info:
                    await collect(engine, prompt, SamplingParams(**{"max_tokens": 4, **overrides}))
            assert info.value.field == field and field in str(info.value)
            assert other.finish_reason == "length" and len(other.token_ids) == 30


async def test_generate_before_start_is_refused(tiny_llama_dir: Path) -> None:
    engine = Engine(tiny_config(tiny_llama_dir))
    with pytest.raises(Exception, match="starting"):
        await collect(engine, PROMPT, greedy(2))
