"""Structured outputs in the engine: every kind of constraint, mixed batches, bad constraints,
and constrained requests through preemption, pause, weight updates and sleep."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import InvalidRequestError, SamplingParams, StructuredOutputsParams, open_engine

from engine_helpers import TIMEOUT, Consumer, collect, generate_all, tiny_config, tokens_of
from structured_helpers import CASES, check_output, text_of

pytestmark = pytest.mark.anyio
PROMPT = "Once upon a time"


def constrained(kind: str, **kwargs: object) -> SamplingParams:
    options: dict[str, object] = {"max_tokens": 200, "temperature": 1.0}
    options.update(kwargs)
    return SamplingParams(structured_outputs=CASES[kind], **options)  # type: ignore[arg-type]


async def test_every_kind_in_one_mixed_batch(tiny_llama_dir: Path) -> None:
    """Each kind, greedy and sampled, beside free requests, in the same steps."""
    prompts = [[5, 6, 7], [9] * 12, [40, 41]]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            free = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
            consumers = [Consumer(engine, p, free) for p in prompts]
            for kind in CASES:
                # Any JSON object has unbounded strings, which a random model rarely ends:
                # one greedy request whose object (this model's, deterministic) is short.
                free_form = kind == "json_object"
                for temperature in (0.0,) if free_form else (0.0, 1.0):
                    for prompt in prompts[:1] if free_form else prompts:
                        params = constrained(kind, temperature=temperature)
                        consumers.append(
                            Consumer(engine, prompt, params, f"{kind}-{len(consumers)}")
                        )
            async with anyio.create_task_group() as tg:
                for consumer in consumers:
                    tg.start_soon(consumer.run)
    for consumer in consumers[: len(prompts)]:
        assert consumer.finish_reason == "length" and len(consumer.token_ids) == 30
    for consumer in consumers[len(prompts) :]:
        assert consumer.error is None and consumer.finish_reason == "stop", consumer.chunks[-1]
        assert consumer.request_id is not None
        check_output(consumer.request_id.split("-")[0], text_of(consumer.chunks))


async def test_seeded_constrained_request_is_the_same_alone_and_preempted(
    tiny_llama_dir: Path,
) -> None:
    """Preemption recomputes a request and its matcher replays: same tokens, valid output."""
    params = constrained("json", seed=7)
    prompts = [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]] * 6
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            alone = await collect(engine, prompts[0], params)
        async with open_engine(tiny_config(tiny_llama_dir, num_blocks=30)) as engine:
            crowd = await generate_all(engine, prompts, params)
            assert engine.stats().num_preemptions_total > 0, "the cache was meant to be small"
    check_output("json", text_of(alone))
    for chunks in crowd:
        assert tokens_of(chunks) == tokens_of(alone)


async def test_bad_constraints_are_refused_at_admission(tiny_llama_dir: Path) -> None:
    bad = {
        "json": {"json": {"type": "objekt"}},
        "regex": {"regex": "(("},
        "grammar": {"grammar": "start: undefined_rule"},
    }
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            for kind, so in bad.items():
                with pytest.raises(InvalidRequestError, match=f"structured_outputs: {kind}: ") as e:
                    engine.generate(PROMPT, SamplingParams(structured_outputs=so))
                assert e.value.field == "structured_outputs"
            assert engine.stats().num_waiting == 0
            chunks = await collect(engine, PROMPT, constrained("choice"))
    check_output("choice", text_of(chunks))


def test_params_take_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(InvalidRequestError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    # Equal schemas, however written, are one constraint (one cache entry).
    a = StructuredOutputsParams(json={"b": 1, "a": [1, 2]})
    assert a == StructuredOutputsParams(json='{"a": [1, 2], "b": 1}')
    assert hash(SamplingParams(structured_outputs=a)) == hash(SamplingParams(structured_outputs=a))


async def test_the_compiler_is_built_by_the_first_constraint(tiny_llama_dir: Path) -> None:
    """Start-up and unconstrained requests never build it (a second for a 50k vocabulary)."""
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            await collect(engine, PROMPT, SamplingParams(max_tokens=2))
            grammars = engine._grammars
            assert grammars is not None and grammars._compiler is None
            await engine.prepare_structured_outputs(constrained("json", max_tokens=4))
            assert grammars._compiler is not None
            assert grammars.cache_info().misses == 1


async def test_compiled_grammars_are_cached(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            for _ in range(3):
                await collect(engine, PROMPT, constrained("json", max_tokens=4))
            info = engine._grammars.cache_info()  # type: ignore[union-attr]
    assert (info.misses, info.hits) == (1, 2)


async def test_pause_update_weights_and_sleep_keep_constraints(tiny_llama_dir: Path) -> None:
    """Mid-request: abort one, pause(keep) + update_weights, then sleep(drain); the others
    stay valid, and a request held while asleep (level 2: weights reloaded) is valid after
    wakeup."""
    with anyio.fail_after(TIMEOUT):
        config = tiny_config(tiny_llama_dir, when_asleep="wait")
        async with open_engine(config) as engine:
            first = Consumer(engine, [5, 6, 7], constrained("json", temperature=0.0))
            second = Consumer(engine, [8, 9], constrained("grammar"))
            held = Consumer(engine, [10, 11], constrained("regex"))
            aborted = Consumer(engine, [12, 13], constrained("json"), "aborted")
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.run)
                tg.start_soon(second.run)
                tg.start_soon(aborted.run)
                await aborted.first_chunk.wait()
                engine.abort("aborted")
                await first.first_chunk.wait()
                await engine.pause("keep")
                await engine.update_weights(tiny_llama_dir)
                await engine.resume()
                await engine.sleep(2, mode="drain")
                tg.start_soon(held.run)
                await anyio.wait_all_tasks_blocked()
                assert engine.stats().num_waiting == 1 and held.error is None
                await engine.wakeup()
    assert engine.weight_version == 2
    assert aborted.finish_reason == "abort"
    for consumer, kind in ((first, "json"), (second, "grammar"), (held, "regex")):
        assert consumer.finish_reason == "stop"
        check_output(kind, text_of(consumer.chunks))


async def test_n_sequences_each_follow_the_constraint(tiny_llama_dir: Path) -> None:
    """``n > 1``: each sequence has its own matcher; compiling first (off the loop) caches."""
    params = constrained("json", n=3, seed=5)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            await engine.prepare_structured_outputs(params)
            chunks = await collect(engine, PROMPT, params)
            info = engine._grammars.cache_info()  # type: ignore[union-attr]
    texts = {i: text_of([c for c in chunks if c.index == i]) for i in range(3)}
    for i, text in texts.items():
        assert [c.finish_reason for c in chunks if c.index == i and c.finish_reason] == ["stop"]
        check_output("json", text)
    assert len(set(texts.values())) > 1, "seeds seed + i should differ"
    assert (info.misses, info.hits) == (1, 3)
