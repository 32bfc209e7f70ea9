"""``memory_stats()`` when the model lives in another process agrees with in-process.

All found by the lifecycle machine. ``ProcessEngine``: the snapshot sent with ``Ready``
reused memory figures read before the model was loaded (memory was only re-read after a
control call or a heartbeat later), so for up to 0.5 s a started engine reported 0 bytes.
``ProcessEngine`` and the ``mp`` executor, after ``stop()``: they reported the last figures
they had from the other process (for ``ProcessEngine`` only when its last snapshot
predated the release), where an in-process engine reports that it holds nothing.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import Engine, ProcessEngine

from engine_helpers import TIMEOUT, tiny_config
from process_helpers import child_pids

pytestmark = pytest.mark.anyio


async def test_memory_stats_right_after_start_shows_the_loaded_model(tiny_llama_dir: Path) -> None:
    children = child_pids()
    engine = ProcessEngine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            memory = list(engine.memory_stats().values())  # no await since started()
            engine.stop()
    assert memory and all(m.weights_bytes > 0 and m.kv_cache_bytes > 0 for m in memory), memory
    stopped = list(engine.memory_stats().values())  # the last snapshot may predate the release
    assert not any(m.weights_bytes or m.kv_cache_bytes or m.host_weights_bytes for m in stopped)
    assert child_pids() <= children


async def test_a_stopped_engine_on_the_mp_executor_holds_no_memory(tiny_llama_dir: Path) -> None:
    children = child_pids()
    engine = Engine(tiny_config(tiny_llama_dir, executor="mp"))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            running = list(engine.memory_stats().values())
            engine.stop()
    stopped = list(engine.memory_stats().values())
    assert running and all(m.weights_bytes > 0 and m.kv_cache_bytes > 0 for m in running)
    assert not any(m.weights_bytes or m.kv_cache_bytes or m.host_weights_bytes for m in stopped)
    assert child_pids() <= children
