"""Faults: a failing or wedged step kills the engine loudly; a missing cache fails one request."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import EngineDeadError, EngineState

from engine_helpers import (
    TIMEOUT,
    Consumer,
    collect,
    engine_threads,
    greedy,
    hf_greedy,
    stream_all,
    tiny_config,
    tokens_of,
)
from fault_injection import FaultInjector, faulty_engine

pytestmark = pytest.mark.anyio
PROMPTS = [[3 + i, 40, 41 + 2 * i, 50, 60 + i, 7] for i in range(8)]


class Boom(RuntimeError):
    pass


async def test_exception_at_step_n_errors_every_request(tiny_llama_dir: Path) -> None:
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir), faults)
    boom = Boom("injected")
    consumers = [Consumer(engine, p, greedy(10_000)) for p in PROMPTS]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                faults.raise_at[faults.num_steps + 2] = boom
                await anyio.sleep_forever()
    dead = info.value.exceptions[0]
    assert dead.__cause__ is boom
    assert [c.finish_reason for c in consumers] == ["error"] * 8
    assert all("Boom" in (c.chunks[-1].error or "") for c in consumers)
    assert engine.state is EngineState.DEAD
    with pytest.raises(EngineDeadError):
        engine.generate("x", greedy(2))
    assert engine_threads() == []


async def test_hang_with_step_timeout_is_a_fault(tiny_llama_dir: Path) -> None:
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir, step_timeout=0.5), faults)
    consumers = [Consumer(engine, p, greedy(10_000)) for p in PROMPTS]
    try:
        with anyio.fail_after(0.5 + TIMEOUT):
            with pytest.RaisesGroup(EngineDeadError) as info:
                async with anyio.create_task_group() as tg:
                    await tg.start(engine.run)
                    await stream_all(tg, consumers)
                    faults.hang_at.add(faults.num_steps + 2)
                    await anyio.sleep_forever()
        # run() ended with the step still wedged, and let go of the model's memory (under
        # trio too, where the wedged thread holds the agent's limiter until it returns)
        assert faults.hanging.is_set() and not faults.hang_returned.is_set()
        held = [(m.weights_bytes, m.kv_cache_bytes) for m in engine.memory_stats().values()]
        assert held == [(0, 0)], held
    finally:
        faults.release()
    assert isinstance(info.value.exceptions[0].__cause__, TimeoutError)
    assert [c.finish_reason for c in consumers] == ["error"] * 8
    await anyio.to_thread.run_sync(faults.hang_returned.wait, TIMEOUT)


async def test_cache_not_ready_fails_one_request_only(tiny_llama_dir: Path) -> None:
    params = greedy(30)
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir), faults)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            want = [tokens_of(await collect(engine, p, params)) for p in PROMPTS]
            consumers = [
                Consumer(engine, p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)
            ]
            await stream_all(tg, consumers)
            faults.cache_not_ready_at[faults.num_steps + 2] = {"r3"}
            for c in consumers:
                await c.done.wait()
            assert engine.state is EngineState.RUNNING
            engine.stop()
    assert consumers[3].finish_reason == "error"
    assert "cache not ready" in (consumers[3].chunks[-1].error or "").lower()
    for i, c in enumerate(consumers):
        if i != 3:
            assert c.finish_reason == "length" and c.token_ids == want[i]


async def test_a_cache_error_leaves_no_prefix_behind(tiny_llama_dir: Path) -> None:
    """The failed step computed none of the victim's KV: later requests must not hit it."""
    prompt, params = list(range(40, 62)), greedy(8)  # five full blocks of four tokens
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir), faults)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            faults.cache_not_ready_at[faults.num_steps + 1] = {"victim"}
            victim = [c async for c in engine.generate(prompt, params, request_id="victim")]
            again = tokens_of(await collect(engine, prompt, params))
            engine.stop()
    assert victim[-1].finish_reason == "error"
    assert again == hf_greedy(tiny_llama_dir, prompt, 8)


async def test_a_failing_cleanup_never_hides_the_fault(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tgengine.agent.agent import ModelAgent

    def broken_release(self: ModelAgent) -> None:
        raise RuntimeError("release failed")

    monkeypatch.setattr(ModelAgent, "_release_all", broken_release)
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir), faults)
    boom = Boom("the original fault")
    consumer = Consumer(engine, PROMPTS[0], greedy(10_000))
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                tg.start_soon(consumer.run)
                await consumer.first_chunk.wait()
                faults.raise_at[faults.num_steps + 1] = boom
                await anyio.sleep_forever()
    assert info.value.exceptions[0].__cause__ is boom
    assert consumer.finish_reason == "error"


async def test_the_event_loop_stays_responsive_during_a_step(tiny_llama_dir: Path) -> None:
    faults = FaultInjector()
    engine = faulty_engine(tiny_config(tiny_llama_dir), faults)
    first = Consumer(engine, PROMPTS[0], greedy(50))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            faults.hang_at.add(faults.num_steps + 1)
            tg.start_soon(first.run)
            await anyio.to_thread.run_sync(faults.hanging.wait)
            # the step is stuck in its worker thread; the loop still admits and aborts
            steps = engine.stats().num_steps
            second = Consumer(engine, PROMPTS[1], greedy(5), request_id="second")
            tg.start_soon(second.run)
            await anyio.wait_all_tasks_blocked()
            engine.abort("second")
            await second.done.wait()
            assert second.finish_reason == "abort" and engine.stats().num_steps == steps
            faults.release()
            await first.done.wait()
            engine.stop()
    assert first.finish_reason == "length"


def test_the_cache_check_names_a_block_outside_the_cache() -> None:
    # The agent's per-sequence check before a forward (``_cache_problem``): a table inside the
    # cache passes; a block past its end or below 0 is named; positions past the table too.
    from types import SimpleNamespace

    from tgengine.agent.agent import ModelAgent
    from tgengine.core.step import SeqStep

    agent = ModelAgent.__new__(ModelAgent)
    agent._kv = SimpleNamespace(block_size=16, num_blocks=10)  # type: ignore[assignment]
    assert agent._cache_problem(SeqStep("a", [1], 40, [0, 9, 3])) is None
    assert agent._cache_problem(SeqStep("b", [1], 0, [2, 10, 11])) == (
        "block 10 is not in the cache (10 blocks)"
    )
    assert agent._cache_problem(SeqStep("c", [1], 0, [-1])) == (
        "block -1 is not in the cache (10 blocks)"
    )
    assert agent._cache_problem(SeqStep("d", [1], 48, [0, 1, 2])) == (
        "positions 48..48 are not in blocks 0..3"
    )
