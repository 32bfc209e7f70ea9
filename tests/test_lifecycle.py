"""stop, pause, sleep/wakeup, weight updates: the lifecycle on both backends."""

from __future__ import annotations

import types
import weakref
from pathlib import Path

import anyio
import pytest
import torch

from tgengine import (
    Engine,
    EnginePausedError,
    EngineSleepingError,
    EngineState,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
    open_engine,
)
from tgengine.models import gemm as gemm_module
from tgengine.models import iter_safetensors
from tgengine.models.gemm import can_prepack

from engine_helpers import (
    TIMEOUT,
    Consumer,
    collect,
    engine_threads,
    generate_all,
    greedy,
    stream_all,
    tiny_config,
    tokens_of,
)
from model_factory import make_tiny_model_dir

pytestmark = pytest.mark.anyio
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3] for i in range(16)]
LONG = greedy(10_000)  # runs until stopped (the tiny model's context caps it at 512)


async def start_consumers(
    engine: Engine, tg: anyio.abc.TaskGroup, n: int, params=LONG
) -> list[Consumer]:  # type: ignore[no-untyped-def]
    consumers = [Consumer(engine, PROMPTS[i % len(PROMPTS)], params) for i in range(n)]
    await stream_all(tg, consumers)
    return consumers


def assert_one_terminal_chunk(consumers: list[Consumer]) -> None:
    for c in consumers:
        reasons = [chunk.finish_reason for chunk in c.chunks]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1]), reasons


@pytest.mark.parametrize("grace", [0.0, 60.0])
async def test_stop_with_16_running(tiny_llama_dir: Path, grace: float) -> None:
    engine = Engine(tiny_config(tiny_llama_dir))
    params = LONG if grace == 0 else greedy(24)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            consumers = await start_consumers(engine, tg, 16, params)
            engine.stop(grace=grace)
            with pytest.raises(EngineStoppedError):
                engine.generate("late", greedy(2))
    assert_one_terminal_chunk(consumers)
    want = "abort" if grace == 0 else "length"
    assert [c.finish_reason for c in consumers] == [want] * 16
    assert engine.state is EngineState.STOPPED
    assert engine_threads() == []


async def test_cancelling_the_task_group_is_stop_grace_0(tiny_llama_dir: Path) -> None:
    engine = Engine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as outer:
            consumers: list[Consumer] = []
            streaming = anyio.Event()

            async def consume() -> None:
                async with anyio.create_task_group() as tg:
                    consumers.extend(await start_consumers(engine, tg, 4))
                    streaming.set()

            async with anyio.create_task_group() as inner:
                await inner.start(engine.run)
                outer.start_soon(consume)
                # an event, not wait_all_tasks_blocked: with requests decoding, the loop is
                # never idle, and that would return only once they had all finished
                await streaming.wait()
                inner.cancel_scope.cancel()
    assert [c.finish_reason for c in consumers] == ["abort"] * 4
    assert engine.state is EngineState.STOPPED


async def test_pause_keep_resumes_with_identical_tokens(tiny_llama_dir: Path) -> None:
    params = greedy(40)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            want = [tokens_of(await collect(engine, p, params)) for p in PROMPTS[:4]]
            async with anyio.create_task_group() as tg:
                consumers = await start_consumers(engine, tg, 4, params)
                await engine.pause("keep")
                await anyio.wait_all_tasks_blocked()  # consumers read what was published
                frozen = [len(c.chunks) for c in consumers]
                steps = engine.stats().num_steps
                await anyio.wait_all_tasks_blocked()
                assert engine.stats().num_steps == steps, "a step ran while paused"
                assert [len(c.chunks) for c in consumers] == frozen
                late = Consumer(engine, PROMPTS[0], params)  # held until resume
                tg.start_soon(late.run)
                await anyio.wait_all_tasks_blocked()
                assert late.chunks == []
                await engine.resume()
    assert [c.token_ids for c in consumers] == want
    assert late.token_ids == want[0]


async def test_pause_abort_and_drain(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            async with anyio.create_task_group() as tg:
                aborted = await start_consumers(engine, tg, 4)
                await engine.pause("abort")
                with pytest.raises(EnginePausedError):
                    engine.generate("x", greedy(2))
                await engine.resume()
                drained = await start_consumers(engine, tg, 4, greedy(20))
                await engine.pause("drain")
                assert engine.stats().num_running == 0
                await anyio.wait_all_tasks_blocked()
                assert all(c.finish_reason == "length" for c in drained)
                await engine.resume()
                await engine.resume()  # idempotent
    assert [c.finish_reason for c in aborted] == ["abort"] * 4
    assert [c.finish_reason for c in drained] == ["length"] * 4


def assert_released(engine: Engine) -> None:
    for stats in engine.memory_stats().values():
        assert stats.kv_cache_bytes == 0 and stats.weights_bytes == 0, stats


@pytest.mark.parametrize("level", [1, 2])
async def test_20_sleep_wakeup_cycles(tiny_llama_dir: Path, level: int) -> None:
    params = greedy(16)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            want = tokens_of(await collect(engine, PROMPTS[1], params))
            for cycle in range(20):
                async with anyio.create_task_group() as tg:
                    running = await start_consumers(engine, tg, 2) if cycle % 5 == 0 else []
                    await engine.sleep(level)
                await engine.sleep(level)  # idempotent
                assert [c.finish_reason for c in running] == ["abort"] * len(running)
                assert engine.state is EngineState.SLEEPING
                assert_released(engine)
                host = sum(s.host_weights_bytes for s in engine.memory_stats().values())
                assert (host > 0) == (level == 1)
                with pytest.raises(EngineSleepingError):
                    engine.generate("x", greedy(2))
                await engine.wakeup()
                await engine.wakeup()  # idempotent
                assert engine.state is EngineState.RUNNING
            assert tokens_of(await collect(engine, PROMPTS[1], params)) == want
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_lets_the_unpacking_buffer_go(
    tiny_llama_dir: Path, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long prompt's products on AMX unpack their weights into a buffer of the compute
    # thread's (up to 16 MiB), reused from product to product; a sleep hands it back. The
    # buffer here stands in for it on any CPU (the module's thread-local, swapped for a
    # namespace that every thread sees).
    buffer = torch.empty(1024, dtype=torch.bfloat16)
    gone = weakref.ref(buffer)
    scratch = types.SimpleNamespace(buffer=buffer)
    monkeypatch.setattr(gemm_module, "_scratch", scratch)
    del buffer
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            await engine.sleep(level)
            assert not hasattr(scratch, "buffer") and gone() is None
            await engine.wakeup()
            assert len(tokens_of(await collect(engine, "x", greedy(3)))) == 3


async def test_partial_wakeup_still_refuses(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            await engine.sleep(1)
            await engine.wakeup(["kv_cache"])
            assert engine.sleeping_tags == {"weights"}
            with pytest.raises(EngineSleepingError, match="weights"):
                engine.generate("x", greedy(2))
            with pytest.raises(IllegalStateError, match="sleeping"):
                await engine.resume()
            await engine.wakeup(["weights"])
            assert not engine.is_sleeping
            assert len(tokens_of(await collect(engine, "x", greedy(3)))) == 3


async def test_when_asleep_wait_holds_requests_until_wakeup(tiny_llama_dir: Path) -> None:
    config = tiny_config(tiny_llama_dir, when_asleep="wait")
    with anyio.fail_after(TIMEOUT):
        async with open_engine(config) as engine:
            want = tokens_of(await collect(engine, PROMPTS[2], greedy(8)))
            await engine.sleep(2)
            async with anyio.create_task_group() as tg:
                held = Consumer(engine, PROMPTS[2], greedy(8))
                tg.start_soon(held.run)
                await anyio.wait_all_tasks_blocked()
                assert held.chunks == [] and engine.stats().num_waiting == 1
                await engine.wakeup(["kv_cache"])
                await anyio.wait_all_tasks_blocked()
                assert held.chunks == []
                await engine.wakeup(["weights"])
    assert held.token_ids == want


def other_weights(tmp_path: Path) -> list[tuple[str, torch.Tensor]]:
    other = make_tiny_model_dir(tmp_path / "other", arch="llama", seed=7)
    return list(iter_safetensors(other)), other  # type: ignore[return-value]


async def test_update_weights_and_the_rl_cycle(tiny_llama_dir: Path, tmp_path: Path) -> None:
    named, other_dir = other_weights(tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(other_dir)) as reference:
            want = tokens_of(await collect(reference, PROMPTS[3], greedy(12)))
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = await collect(engine, PROMPTS[3], greedy(12))
            assert before[-1].weight_version == 0
            await engine.sleep(2)
            await engine.wakeup(["weights"])
            await engine.update_weights(named)
            await engine.wakeup(["kv_cache"])
            after = await collect(engine, PROMPTS[3], greedy(12))
            assert tokens_of(after) == want != tokens_of(before)
            assert {c.weight_version for c in after} == {engine.weight_version}
            await engine.update_weights(tiny_llama_dir)  # a directory of safetensors
            assert tokens_of(await collect(engine, PROMPTS[3], greedy(12))) == tokens_of(before)


def weights_bytes(engine: Engine) -> int:
    return sum(s.weights_bytes for s in engine.memory_stats().values())


def checkpoint_bytes(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> int:
    return sum(t.numel() * dtype.itemsize for _, t in named)


# bfloat16 where this CPU packs it (AVX-512), else float32, which oneDNN packs everywhere.
PACKED_DTYPE = torch.bfloat16 if can_prepack(torch.bfloat16) else torch.float32


@pytest.mark.skipif(not can_prepack(PACKED_DTYPE), reason="oneDNN packs no dtype here")
async def test_packed_weights_are_the_only_copy_and_follow_updates_and_sleep(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # With prepack_weights, every linear weight lives in oneDNN's packed layout only: the
    # resident bytes equal the checkpoint's, after a batched step too; every change of the
    # weights (update, sleep, wakeup) reaches the packed form, or the engine keeps the old model.
    named, other_dir = other_weights(tmp_path)
    named = [(name, t.to(PACKED_DTYPE)) for name, t in named]
    original = [(name, t.to(PACKED_DTYPE)) for name, t in iter_safetensors(tiny_llama_dir)]
    size = checkpoint_bytes(original, PACKED_DTYPE)
    packed = {"dtype": str(PACKED_DTYPE).removeprefix("torch."), "prepack_weights": True}
    prompts, params = PROMPTS[:4], greedy(12)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(other_dir, **packed)) as reference:
            want = [tokens_of(r) for r in await generate_all(reference, prompts, params)]
        async with open_engine(tiny_config(tiny_llama_dir, **packed)) as engine:
            before = [tokens_of(r) for r in await generate_all(engine, prompts, params)]
            # one copy: the placeholders of the packed parameters add a few bytes each
            assert size <= weights_bytes(engine) <= size * 1.01
            await engine.update_weights(named)
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == want
            assert want != before
            assert size <= weights_bytes(engine) <= size * 1.01
            await engine.sleep(1)
            assert weights_bytes(engine) == 0
            assert size <= host_weights_bytes(engine) <= size * 1.01
            await engine.wakeup()
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == want
            await engine.sleep(2)
            assert weights_bytes(engine) == host_weights_bytes(engine) == 0
            await engine.wakeup()  # reloads the original weights from disk, packed again
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == before
            assert size <= weights_bytes(engine) <= size * 1.01
            await engine.update_weights(original)
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == before


async def test_unpacked_weights_are_one_copy_too(tiny_llama_dir: Path) -> None:
    original = list(iter_safetensors(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, prepack_weights=False)) as engine:
            await generate_all(engine, PROMPTS[:4], greedy(4))
            size = checkpoint_bytes(original, torch.float32)
            assert weights_bytes(engine) == size


def host_weights_bytes(engine: Engine) -> int:
    return sum(s.host_weights_bytes for s in engine.memory_stats().values())


async def test_invalid_weights_change_nothing(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            want = tokens_of(await collect(engine, PROMPTS[4], greedy(8)))
            good = list(iter_safetensors(tiny_llama_dir))
            name, tensor = good[0]
            bad_sources = {
                "unknown": [*good[1:], ("model.nope.weight", tensor)],
                "shape": [*good[1:], (name, tensor[:1])],
                "dtype": [*good[1:], (name, tensor.to(torch.int32))],
            }
            for kind, source in bad_sources.items():
                # good tensors come first: an invalid last one must still apply nothing
                source = [(n, t * 0) for n, t in source[:-1]] + [source[-1]]
                with pytest.raises(InvalidRequestError, match="weights"):
                    await engine.update_weights(source)
                assert engine.weight_version == 0, kind
            assert tokens_of(await collect(engine, PROMPTS[4], greedy(8))) == want


async def test_illegal_calls_name_the_state(tiny_llama_dir: Path) -> None:
    engine = Engine(tiny_config(tiny_llama_dir))
    with pytest.raises(IllegalStateError, match="starting"):
        await engine.pause()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            with pytest.raises(IllegalStateError, match="running"):
                await tg.start(engine.run)
            engine.stop()
    with pytest.raises(IllegalStateError, match="stopped"):
        await engine.sleep()
    with pytest.raises(EngineStoppedError):
        engine.generate("x")
