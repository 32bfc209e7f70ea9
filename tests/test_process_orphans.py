"""No orphan engine process: it exits by itself within 5 s of its parent dying."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from process_helpers import child_pids

PARENT = """
import sys
import anyio
from tgengine import EngineConfig, ProcessEngine

async def main() -> None:
    config = EngineConfig(model=sys.argv[1], dtype="float32", block_size=4, num_blocks=64)
    client = ProcessEngine(config)
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        print(client.pid, flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


def test_engine_process_exits_when_its_parent_is_killed(tiny_llama_dir: Path) -> None:
    before = child_pids()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True
    )
    engine_process: psutil.Process | None = None
    try:
        assert parent.stdout is not None
        readable, _, _ = select.select([parent.stdout], [], [], 120)
        assert readable, "the parent never reported its engine process"
        engine_process = psutil.Process(int(parent.stdout.readline()))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        engine_process.wait(timeout=5)  # psutil.TimeoutExpired fails the test
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if engine_process is not None and engine_process.is_running():
            engine_process.kill()
    assert child_pids() == before
