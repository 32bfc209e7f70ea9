"""The engine process's ``memory_stats()`` is fresh once ``started()`` returns, as in-process.

Found by the lifecycle machine against ``ProcessEngine``: the snapshot sent with ``Ready``
reused memory figures read before the model was loaded (memory was only re-read after a
control call or a heartbeat later), so for up to 0.5 s a started engine reported 0 bytes.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import ProcessEngine

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
    assert child_pids() <= children
