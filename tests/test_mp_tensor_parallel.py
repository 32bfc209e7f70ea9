"""Faults of one rank out of two (rank 0 is then left inside a collective).

Tokens, memory per rank, weight updates and sleep at size 2 through the same executor are
test_tensor_parallel.py's. Every test counts this process's children before and after.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from tgengine import Engine, EngineDeadError
from tgengine.errors import WorkerExited, WorkerFailed

from engine_helpers import (
    TIMEOUT,
    Consumer,
    greedy,
    make_prompts,
    stream_all,
    tiny_config,
)
from fault_injection import FaultInjector, faulty_engine
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
ENDLESS = greedy(10_000)


class Boom(RuntimeError):
    pass


def tp2_config(model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return tiny_config(model_dir, tensor_parallel_size=2, **overrides)  # mp: the default


async def test_killing_rank_1_errors_every_request_at_once(tiny_llama_dir: Path) -> None:
    before = child_pids()
    engine = Engine(tp2_config(tiny_llama_dir))
    prompts = make_prompts(vocab_size=384, count=4)
    consumers = [Consumer(engine, p, ENDLESS) for p in prompts]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                rank1 = engine._executor.pids[1]  # type: ignore[attr-defined]
                os.kill(rank1, signal.SIGKILL)
                killed = time.monotonic()
                for c in consumers:
                    await c.done.wait()
                ended = time.monotonic() - killed
                await anyio.sleep_forever()
    assert ended < 2.0
    assert [c.finish_reason for c in consumers] == ["error"] * len(prompts)
    cause = info.value.exceptions[0].__cause__
    assert isinstance(cause, WorkerExited) and cause.rank == 1
    assert "rank 1" in str(cause) and "SIGKILL" in str(cause)
    assert child_pids() == before, "rank 0, stuck in a collective, was killed too"


async def test_rank_1_raising_names_rank_and_error(tiny_llama_dir: Path) -> None:
    before = child_pids()
    faults = FaultInjector(ranks={1})
    engine = faulty_engine(tp2_config(tiny_llama_dir), faults)
    consumers = [Consumer(engine, p, ENDLESS) for p in make_prompts(vocab_size=384, count=3)]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                faults.raise_at[faults.num_steps + 2] = Boom("rank 1 only")
                await anyio.sleep_forever()
    cause = info.value.exceptions[0].__cause__
    assert isinstance(cause, WorkerFailed) and cause.rank == 1
    assert "Boom: rank 1 only" in str(cause)
    assert all(c.finish_reason == "error" for c in consumers)
    assert child_pids() == before
