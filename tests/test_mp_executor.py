"""The ``mp`` executor with one worker: the same tokens as in-process, control calls, a hang.

A killed or raising rank is tested with two ranks (test_mp_tensor_parallel.py), where the
other rank is left inside a collective. Every test counts this process's children before
and after (no worker may survive).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

from tgengine import Engine, EngineDeadError, EngineState, InvalidRequestError
from tgengine.errors import StepTimeoutError
from tgengine.models import iter_safetensors

from engine_helpers import (
    TIMEOUT,
    Consumer,
    collect,
    greedy,
    hf_greedy,
    stream_all,
    tiny_config,
    tokens_of,
)
from fault_injection import FaultInjector, faulty_engine
from process_helpers import child_pids, worker_pids

pytestmark = pytest.mark.anyio
PROMPTS = [[3 + i, 40, 41 + 2 * i, 50, 60 + i, 7] for i in range(4)]
ENDLESS = greedy(10_000)


def mp_config(model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return tiny_config(model_dir, executor="mp", **overrides)


async def test_one_worker_serves_like_uni_and_obeys_every_control_call(
    tiny_llama_dir: Path,
) -> None:
    """One engine for many checks: a worker start costs seconds."""
    before = child_pids()
    faults = FaultInjector()
    engine = faulty_engine(mp_config(tiny_llama_dir), faults)
    params = greedy(8)
    want = [hf_greedy(tiny_llama_dir, p, 8) for p in PROMPTS]
    weights = list(iter_safetensors(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert len(worker_pids()) == 1
            got = [tokens_of(await collect(engine, p, params)) for p in PROMPTS]
            assert got == want

            (device, stats), *others = engine.memory_stats().items()
            assert not others and stats.weights_bytes > 0 and stats.kv_cache_bytes > 0
            await engine.sleep(1)
            asleep = engine.memory_stats()[device]
            assert asleep.kv_cache_bytes == 0 and asleep.host_weights_bytes > 0
            await engine.wakeup()
            assert tokens_of(await collect(engine, PROMPTS[0], params)) == want[0]

            name, tensor = weights[0]
            with pytest.raises(InvalidRequestError, match=name):
                await engine.update_weights([(name, tensor[:1])])
            assert engine.weight_version == 0
            await engine.update_weights(weights)
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPTS[1], params)) == want[1]

            consumers = [Consumer(engine, p, greedy(30), f"r{i}") for i, p in enumerate(PROMPTS)]
            await stream_all(tg, consumers)
            faults.cache_not_ready_at[faults.num_steps + 2] = {"r2"}
            for c in consumers:
                await c.done.wait()
            assert engine.state is EngineState.RUNNING
            engine.stop()
    assert [c.finish_reason for c in consumers] == ["length", "length", "error", "length"]
    assert "cache not ready" in (consumers[2].chunks[-1].error or "").lower()
    assert child_pids() == before


async def test_a_hung_rank_ends_the_engine_at_step_timeout(tiny_llama_dir: Path) -> None:
    before = child_pids()
    engine = Engine(mp_config(tiny_llama_dir, step_timeout=1.0))
    consumers = [Consumer(engine, p, ENDLESS) for p in PROMPTS]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                (pid,) = worker_pids()
                os.kill(pid, signal.SIGSTOP)
                await anyio.sleep_forever()
    assert isinstance(info.value.exceptions[0].__cause__, StepTimeoutError)
    assert [c.finish_reason for c in consumers] == ["error"] * len(PROMPTS)
    assert child_pids() == before, "the stopped worker was killed"
