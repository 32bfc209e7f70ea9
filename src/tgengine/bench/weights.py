"""``bench weights``: a full weight update, timed and its peak RSS measured.

Every way in is timed on the same engine and the same bytes: ``update_weights(dir)``, a
one-part ``update_weights(tensors)``, ``weight_update()`` in parts (awake), and the same
parts with the weights asleep at level 2 (the parts become the weights; the wakeup is timed
with them). The physical limit is a plain ``copy_`` of the same bytes, measured in the run;
with the weights released (level 2) the limit is a copy into memory allocated then (``memcpy
into new memory``: first-touch page faults included). Peak RSS is the process's high-water
mark over each operation (``peak_rss``), above the RSS at its start (what the update itself
needs beyond the engine already loaded; asleep, beyond the engine whose weights were
released: the goal there is the weights, one part and 10 % of the weights).
Then the same tensors from another process (``weights_remote``): through ``ProcessEngine``
(``update_weights(dir)`` and ``weight_update()`` in parts), and over HTTP from a client
process, to a server whose engine runs in its process or in an engine process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import torch

from ..engine.engine import Engine
from ..models import iter_safetensors
from ..runtime import huge_pages
from .common import BenchSetup
from .engine_run import engine_config, warm_up
from .weights_remote import http_rows, measured, process_engine_rows

_MIB = 1024**2
Named = list[tuple[str, torch.Tensor]]


def _parts(named: Named, part_bytes: int) -> list[Named]:
    """``named`` in consecutive parts of about ``part_bytes`` each (a tensor never split)."""
    parts: list[Named] = [[]]
    size = 0
    for name, tensor in named:
        if parts[-1] and size + tensor.nbytes > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append((name, tensor))
        size += tensor.nbytes
    return parts


def _memcpy_seconds(named: Named, repeats: int) -> float:
    """The fastest of ``repeats`` plain copies of every tensor into a buffer of its own
    (touched once first: the limit is the copy, not the kernel's first-touch page faults)."""
    dst = [torch.empty_like(t) for _, t in named]
    for d, (_, t) in zip(dst, named, strict=True):
        d.copy_(t)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for d, (_, t) in zip(dst, named, strict=True):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
    return best


def _fresh_memcpy_seconds(named: Named, repeats: int) -> float:
    """The fastest of ``repeats`` copies of every tensor into memory allocated for it then
    (as the engine allocates weights: ``huge_pages.empty``): what re-acquiring released
    weights costs at the least, first-touch page faults included (on a VM, the host's too)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        dst = [huge_pages.empty(t.shape, t.dtype) for _, t in named]
        for d, (_, t) in zip(dst, named, strict=True):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
        del dst
    return best


async def _measured(action: Callable[[], Awaitable[object]]) -> tuple[float, int]:
    """Seconds ``action`` took, and its peak RSS above the RSS when it began (freed heap
    handed back first: else a reused free heap hides what the action needs)."""
    gc.collect()
    seconds, peaks, _ = await measured(action, {"self": os.getpid()})
    return seconds, peaks["self"]


async def _push(engine: Engine, parts: list[Named]) -> None:
    async with engine.weight_update() as update:
        for part in parts:
            await update.push(part)


async def _push_and_wake(engine: Engine, parts: list[Named]) -> None:
    await _push(engine, parts)
    await engine.wakeup(["weights"])


async def _nothing() -> None:
    pass


async def _weights(
    setup: BenchSetup, part_bytes: int, repeats: int, remote: bool
) -> dict[str, Any]:
    config = engine_config(setup)
    engine = Engine(config)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await warm_up(engine)
        dtype = engine._info.dtype if engine._info else torch.float32
        named = [(n, t.to(dtype)) for n, t in iter_safetensors(setup.model_dir)]
        specs = engine._info.weight_specs if engine._info else {}
        named = [(n, t) for n, t in named if n in specs]
        total = sum(t.nbytes for _, t in named)
        weights = sum(s.weights_bytes for s in engine.memory_stats().values())
        parts = _parts(named, part_bytes)
        memcpy = await anyio.to_thread.run_sync(_memcpy_seconds, named, repeats)
        # (what runs first, unmeasured; what is measured): asleep, the peak is over the RSS
        # of the engine with its weights released
        ways: dict[str, tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[object]]]]
        ways = {
            "update_weights(dir)": (_nothing, partial(engine.update_weights, setup.model_dir)),
            "update_weights(tensors)": (_nothing, partial(engine.update_weights, named)),
            f"weight_update() in {len(parts)} parts": (_nothing, partial(_push, engine, parts)),
            f"asleep (level 2): {len(parts)} parts + wakeup": (
                partial(engine.sleep, 2),
                partial(_push_and_wake, engine, parts),
            ),
        }
        fresh = await anyio.to_thread.run_sync(_fresh_memcpy_seconds, named, repeats)
        rows: list[dict[str, Any]] = [
            {"path": "memcpy (the limit)", "seconds": memcpy, "peak_rss_over_bytes": 0},
            {"path": "memcpy into new memory", "seconds": fresh, "peak_rss_over_bytes": 0},
        ]
        for name, (before, action) in ways.items():
            runs = []
            for _ in range(repeats):
                await before()
                runs.append(await _measured(action))
            seconds = min(s for s, _ in runs)
            rows.append(
                {"path": name, "seconds": seconds, "peak_rss_over_bytes": max(p for _, p in runs)}
            )
        version = engine.weight_version
        tg.cancel_scope.cancel()
    if remote:
        rows += await process_engine_rows(setup, parts, repeats)
        for engine_process in (False, True):
            rows += await http_rows(
                setup, named, part_bytes, repeats, engine_process=engine_process
            )
    for row in rows:
        row["gb_per_s"] = total / row["seconds"] / 1e9
        row["fraction_of_memcpy"] = memcpy / row["seconds"]
        row["peak_over_weights"] = (row["peak_rss_over_bytes"] or 0) / max(1, weights)
    return {
        "rows": rows,
        "update_bytes": total,
        "weights_bytes": weights,
        "part_bytes": part_bytes,
        "num_parts": len(parts),
        "weight_version": version,
    }


def run_weights(
    setup: BenchSetup, *, part_mib: int = 64, repeats: int = 3, remote: bool = True
) -> dict[str, Any]:
    result = anyio.run(partial(_weights, setup, part_mib * _MIB, repeats, remote))
    return {
        "bench": "weights",
        "workload": {"part_mib": part_mib, "repeats": repeats, "model": setup.model_dir},
        **result,
    }


def add_parser(benches: Any, common: Callable[[Any], None], handler: Callable[..., int]) -> None:
    """Register ``bench weights``: ``common`` adds the options every bench takes."""
    p = benches.add_parser(
        "weights", help="a full weight update: time and peak RSS of each way in, vs memcpy"
    )
    common(p)
    p.add_argument("--part-mib", type=int, help="MiB per pushed part (default: 64; quick: 1)")
    p.add_argument("--repeats", type=int, help="runs of each; the fastest counts (default: 3)")
    p.add_argument(
        "--remote",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also from another process: ProcessEngine, and HTTP from a client process "
        "(default: on)",
    )
    p.add_argument(
        "--synthetic-1b",
        action="store_true",
        help="the synthetic 1B Llama of bench memory (written once to the cache dir) "
        "instead of --model",
    )
    p.set_defaults(handler=handler, runner=_from_args)


def _from_args(setup: BenchSetup, args: Any) -> dict[str, Any]:
    quick = bool(args.quick)
    part_mib = args.part_mib if args.part_mib is not None else (1 if quick else 64)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    if args.synthetic_1b:
        from ..runtime.disk_cache import cache_root
        from .memory import write_synthetic_1b

        path = cache_root() / "synthetic-llama-1b"
        setup = dataclasses.replace(setup, model_dir=str(write_synthetic_1b(path)))
    return run_weights(setup, part_mib=part_mib, repeats=repeats, remote=args.remote)
