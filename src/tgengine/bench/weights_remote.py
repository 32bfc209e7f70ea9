"""``bench weights`` from another process: through ``ProcessEngine``, and over HTTP.

Each way is one full update of the same tensors, timed end to end (from opening the update
to its commit's answer). Peak RSS is measured in every process involved (its high-water
mark: ``peak_rss``), each above its own RSS at the start: the engine's (where the weights
live), the sender's (the trainer: this bench process for ``ProcessEngine``, a client process
for HTTP) and, for HTTP to an engine process, the server's in between; ``/dev/shm``'s use is
sampled (the parts cross there, one at a time).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import torch

from ..agent.host_memory import trim_host_heap
from ..engine.client import EngineClient
from ..engine.engine import Engine
from ..ipc.weights_file import SHARED_MEMORY
from ..process.client import ProcessEngine
from ..server import Server, ServerConfig
from .common import BenchSetup
from .engine_run import engine_config
from .peak_rss import PeakRSS

Named = list[tuple[str, torch.Tensor]]
ADMIN_KEY = "bench-weights"


def _shm_used() -> int:
    return shutil.disk_usage(SHARED_MEMORY).used if SHARED_MEMORY.is_dir() else 0


SHM_PERIOD = 0.005  # seconds between two looks at /dev/shm (a part's file lives longer)


async def measured(
    action: Callable[[], Awaitable[Any]], pids: dict[str, int]
) -> tuple[float, dict[str, int], Any]:
    """Seconds ``action`` took, each process's peak RSS above its start (by role: their
    high-water marks, ``PeakRSS``), ``shm``: /dev/shm's peak use above its start (looked at
    every ``SHM_PERIOD``), and what ``action`` returned."""
    trim_host_heap()
    rss = PeakRSS(pids)
    shm_base = shm_peak = _shm_used()

    async def watch_shm() -> None:
        nonlocal shm_peak
        while True:
            shm_peak = max(shm_peak, _shm_used())
            await anyio.sleep(SHM_PERIOD)

    async with anyio.create_task_group() as tg, rss.watching():
        tg.start_soon(watch_shm)
        start = time.perf_counter()
        try:
            result = await action()
        finally:
            seconds = time.perf_counter() - start
            tg.cancel_scope.cancel()
    shm_peak = max(shm_peak, _shm_used())
    return seconds, rss.peaks() | {"shm": shm_peak - shm_base}, result


async def _push(engine: EngineClient, parts: list[Named]) -> None:
    async with engine.weight_update() as update:
        for part in parts:
            await update.push(part)


def _row(
    path: str,
    runs: list[tuple[float, dict[str, int], Any]],
    engine: str,
    sender: str | None,
    relay: str | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    def peak(role: str | None) -> int | None:
        return None if role is None else max(p[role] for _, p, _ in runs)

    return {
        "path": path,
        "seconds": seconds if seconds is not None else min(s for s, _, _ in runs),
        "peak_rss_over_bytes": peak(engine),
        "sender_peak_rss_over_bytes": peak(sender),
        "relay_peak_rss_over_bytes": peak(relay),
        "shm_peak_bytes": peak("shm"),
    }


async def process_engine_rows(
    setup: BenchSetup, parts: list[Named], repeats: int
) -> list[dict[str, Any]]:
    """``ProcessEngine``: ``update_weights(dir)`` and ``weight_update()`` in parts, sent
    from this process (the trainer) to the engine process, awake and with its weights
    asleep at level 2 (the wakeup timed with them); a fresh engine process for each way
    (its freed heap is not handed back: a later way would reuse it unseen)."""

    async def asleep(engine: ProcessEngine) -> None:
        await _push(engine, parts)
        await engine.wakeup(["weights"])

    async def awake(engine: ProcessEngine) -> None:
        pass

    ways: dict[str, tuple[Callable[[ProcessEngine], Awaitable[Any]], ...]] = {
        "ProcessEngine: update_weights(dir)": (
            awake,
            lambda e: e.update_weights(setup.model_dir),
        ),
        f"ProcessEngine: weight_update() in {len(parts)} parts": (
            awake,
            lambda e: _push(e, parts),
        ),
        f"ProcessEngine asleep (level 2): {len(parts)} parts + wakeup": (
            lambda e: e.sleep(2),
            asleep,
        ),
    }
    rows = []
    for name, (before, way) in ways.items():
        engine = ProcessEngine(engine_config(setup))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert engine.pid is not None
            pids = {"engine": engine.pid, "sender": os.getpid()}
            runs = []
            for _ in range(repeats):
                await before(engine)
                runs.append(await measured(partial(way, engine), pids))
            rows.append(_row(name, runs, "engine", "sender" if "parts" in name else None))
            engine.stop()
    return rows


async def http_rows(
    setup: BenchSetup, named: Named, part_bytes: int, repeats: int, *, engine_process: bool
) -> list[dict[str, Any]]:
    """A client process pushes updates over HTTP to a server in this process, whose
    engine runs here (``engine_process`` False) or in an engine process of its own:
    ``repeats`` updates in a row each way (the fastest counts), each part as the body, then
    each part's path in /dev/shm (read before the answer), then held until the commit."""
    config = engine_config(setup)
    engine: EngineClient = ProcessEngine(config) if engine_process else Engine(config)
    server = Server(engine, ServerConfig(port=0, admin_key=ADMIN_KEY))
    dtype = str(named[0][1].dtype).removeprefix("torch.")
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await tg.start(server.run)
        spec = {
            "url": server.url,
            "admin_key": ADMIN_KEY,
            "model_dir": setup.model_dir,
            "names": [n for n, _ in named],
            "dtype": dtype,
            "part_bytes": part_bytes,
        }
        ways = {}
        for shared, hold in ((False, False), (True, False), (True, True)):
            # one client, ``repeats`` updates in a row (a trainer's loop): the fastest counts
            way = {**spec, "shared": shared, "hold": hold, "updates": repeats}
            ways[shared, hold] = [await _http_once(way, engine, engine_process)]
        tg.cancel_scope.cancel()
    where = "an engine process" if engine_process else "the server's process"
    rows = []
    for (shared, hold), runs in ways.items():
        how = "paths held until the commit" if hold else "paths in /dev/shm" if shared else "parts"
        name = f"HTTP from another process, engine in {where}: {runs[0][2]['num_parts']} {how}"
        seconds = min(r[2]["seconds"] for r in runs)
        for _, peaks, result in runs:
            peaks["client"] = result["peak_rss_over_bytes"]
        if engine_process:
            rows.append(_row(name, runs, "engine", "client", "server", seconds=seconds))
        else:
            rows.append(_row(name, runs, "server", "client", seconds=seconds))
    return rows


async def _http_once(
    spec: dict[str, Any], engine: EngineClient, engine_process: bool
) -> tuple[float, dict[str, int], Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    pids = {"server": os.getpid()}
    if engine_process:
        assert isinstance(engine, ProcessEngine) and engine.pid is not None
        pids["engine"] = engine.pid
    command = [sys.executable, "-m", "tgengine.bench.weights_client", f.name]
    try:
        # The client loads its tensors before its clock starts: the time and peaks that
        # count are its own figures, and the server side's sampled here meanwhile.
        seconds, peaks, done = await measured(partial(anyio.run_process, command), pids)
    finally:
        os.unlink(f.name)
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return seconds, peaks, result
