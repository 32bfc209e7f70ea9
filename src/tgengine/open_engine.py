"""``open_engine``: an Engine as an async context manager."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from .config import EngineConfig
from .engine import Engine


@asynccontextmanager
async def open_engine(config: EngineConfig, *, grace: float = 0.0) -> AsyncIterator[Engine]:
    """Start an engine in a task group of its own; stop it (with ``grace``) on exit.

    A single exception from the body or the engine is re-raised as itself, not as an
    ``ExceptionGroup``.
    """
    engine = Engine(config)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            try:
                yield engine
            finally:
                engine.stop(grace)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
