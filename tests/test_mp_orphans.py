"""No orphan worker: an ``mp`` worker exits by itself within 5 s of its parent dying."""

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
from tgengine import Engine, EngineConfig

async def main() -> None:
    config = EngineConfig(model=sys.argv[1], dtype="float32", block_size=4, num_blocks=64,
                          executor="mp")
    engine = Engine(config)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        print(*engine._executor.pids, flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


def test_workers_exit_when_their_parent_is_killed(tiny_llama_dir: Path) -> None:
    before = child_pids()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True
    )
    workers: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        readable, _, _ = select.select([parent.stdout], [], [], 120)
        assert readable, "the parent never reported its workers"
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert len(workers) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        for worker in workers:
            worker.wait(timeout=5)  # psutil.TimeoutExpired fails the test
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for worker in workers:
            if worker.is_running():
                worker.kill()
    assert child_pids() == before
