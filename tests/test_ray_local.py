"""The ``ray`` executor with no address: a private local Ray, started and stopped with it.

Nothing of it may outlive the engine: no Ray process (the GCS, the raylet, the workers
are this process's children while they run), and no Ray session left connected.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import Engine, EngineState

from engine_helpers import Consumer, greedy, stream_all, tiny_config
from process_helpers import child_pids
from ray_helpers import wait_gone

pytestmark = pytest.mark.anyio
TIMEOUT = 240  # seconds: Ray's start, and actors importing torch on a shared machine


async def test_a_local_ray_is_started_for_the_engine_and_gone_after_a_cancel(
    tiny_llama_dir: Path,
) -> None:
    import ray

    assert not ray.is_initialized()
    before = child_pids()
    config = tiny_config(tiny_llama_dir, executor="ray", tensor_parallel_size=2)
    engine = Engine(config)
    consumer = Consumer(engine, [5, 6, 7, 8], greedy(10_000))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert ray.is_initialized()
            started = child_pids() - before
            assert len(started) >= 4  # the GCS, the raylet and two rank actors at least
            await stream_all(tg, [consumer])
            tg.cancel_scope.cancel()  # the same as stop(grace=0)
    assert engine.state is EngineState.STOPPED
    assert consumer.token_ids  # it streamed before the cancel
    assert not ray.is_initialized()
    assert not wait_gone(child_pids() - before), "a Ray process outlived the engine"
