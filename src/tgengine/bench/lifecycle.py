"""``bench lifecycle``: how long stop, pause, sleep and wakeup take with requests running,
what memory sleep really releases, and whether sleep/wakeup cycles leak.

Every timed operation starts with ``num_running`` requests in flight (long, greedy, EOS
ignored), so each one includes waiting for the step in flight, as a real caller would.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from functools import partial
from typing import Any

import anyio
import anyio.abc

from ..engine.engine import Engine
from .common import BenchSetup, rss_bytes
from .engine_run import engine_config, greedy, warm_up
from .workload import fixed_workload


def _memory(engine: Engine) -> dict[str, Any]:
    return {
        "rss_bytes": rss_bytes(),
        "memory_stats": {device: asdict(s) for device, s in engine.memory_stats().items()},
    }


@asynccontextmanager
async def _running(
    engine: Engine, prompts: list[list[int]], max_tokens: int
) -> AsyncIterator[None]:
    """``len(prompts)`` requests in flight (each streamed a token) while the body runs.

    On exit, waits until each has ended; the body ends them (pause, sleep, stop) or they
    are aborted here.
    """
    ids = [f"lifecycle-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    started = [anyio.Event() for _ in prompts]

    async def consume(i: int) -> None:
        try:
            async for chunk in engine.generate(prompts[i], greedy(max_tokens), request_id=ids[i]):
                if chunk.token_ids:
                    started[i].set()
        finally:
            started[i].set()

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(consume, i)
        for event in started:
            await event.wait()
        yield
        for request_id in ids:
            engine.abort(request_id)


async def _timed(action: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await action()
    return time.perf_counter() - start


async def _lifecycle(
    setup: BenchSetup, num_running: int, cycles: int, drift_level: int, max_tokens: int
) -> dict[str, Any]:
    mc = setup.model_config()
    prompt_len = min(64, mc.max_position_embeddings // 4)
    max_tokens = min(max_tokens, mc.max_position_embeddings - prompt_len - 1)
    prompts = [r.prompt for r in fixed_workload(num_running, prompt_len, 1, mc.vocab_size)]
    config = engine_config(setup)
    engine = Engine(config)
    ended = anyio.Event()
    seconds: dict[str, float] = {}
    memory: dict[str, Any] = {}

    async def run_engine(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await engine.run(task_status=task_status)
        finally:
            ended.set()

    running = partial(_running, engine, prompts, max_tokens)
    async with anyio.create_task_group() as tg:
        await tg.start(run_engine)
        await warm_up(engine)
        async with running():
            seconds["pause (keep)"] = await _timed(partial(engine.pause, "keep"))
            seconds["resume"] = await _timed(engine.resume)
            seconds["pause (abort)"] = await _timed(partial(engine.pause, "abort"))
        await engine.resume()
        for level in (1, 2):
            async with running():
                memory[f"before sleep({level})"] = _memory(engine)
                seconds[f"sleep({level})"] = await _timed(partial(engine.sleep, level))
            memory[f"during sleep({level})"] = _memory(engine)
            seconds[f"wakeup after sleep({level})"] = await _timed(engine.wakeup)
            memory[f"after wakeup from sleep({level})"] = _memory(engine)
        drift = await _drift(engine, prompts[:4], cycles, drift_level)
        async with running():
            start = time.perf_counter()
            engine.stop()
            await ended.wait()
            seconds["stop"] = time.perf_counter() - start
        tg.cancel_scope.cancel()
    return {"seconds": seconds, "memory": memory, "drift": drift}


async def _drift(
    engine: Engine, prompts: list[list[int]], cycles: int, level: int
) -> dict[str, Any]:
    """RSS across ``cycles`` rounds of (a few requests, sleep(level), wakeup)."""
    rss = [rss_bytes()]
    for _ in range(cycles):
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(_drain, engine, prompt)
        await engine.sleep(level)
        await engine.wakeup()
        rss.append(rss_bytes())
    return {
        "cycles": cycles,
        "level": level,
        "rss_before_bytes": rss[0],
        "rss_after_bytes": rss[-1],
        "rss_drift_bytes": rss[-1] - rss[0],
        "rss_after_first_cycle_bytes": rss[1] if len(rss) > 1 else rss[0],
        "rss_drift_after_first_cycle_bytes": rss[-1] - (rss[1] if len(rss) > 1 else rss[0]),
        "rss_per_cycle_bytes": rss,
    }


async def _drain(engine: Engine, prompt: list[int]) -> None:
    async for _ in engine.generate(prompt, greedy(8)):
        pass


def run_lifecycle(
    setup: BenchSetup,
    *,
    num_running: int = 16,
    cycles: int = 20,
    drift_level: int = 1,
    max_tokens: int = 4096,
) -> dict[str, Any]:
    result = anyio.run(partial(_lifecycle, setup, num_running, cycles, drift_level, max_tokens))
    return {
        "bench": "lifecycle",
        "workload": {"num_running": num_running, "cycles": cycles, "drift_level": drift_level},
        **result,
    }
