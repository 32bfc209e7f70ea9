"""``open_engine``: an engine as an async context manager, in this process or its own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Literal, overload

import anyio

from .config import EngineConfig
from .engine.client import EngineClient
from .engine.engine import Engine

if TYPE_CHECKING:
    from .process import ProcessEngine


@overload
def open_engine(
    config: EngineConfig, *, grace: float = ..., process: Literal[False] = ...
) -> AbstractAsyncContextManager[Engine]: ...


@overload
def open_engine(
    config: EngineConfig, *, grace: float = ..., process: Literal[True]
) -> AbstractAsyncContextManager[ProcessEngine]: ...


def open_engine(
    config: EngineConfig, *, grace: float = 0.0, process: bool = False
) -> AbstractAsyncContextManager[EngineClient]:
    """Start an engine in a task group of its own; stop it (with ``grace``) on exit.

    ``process=True`` runs the engine in a child process behind the same API
    (``ProcessEngine``). A single exception from the body or the engine is re-raised as
    itself, not as an ``ExceptionGroup``.
    """
    if process:
        from .process import ProcessEngine

        return _opened(ProcessEngine(config), grace)
    return _opened(Engine(config), grace)


@asynccontextmanager
async def _opened(engine: EngineClient, grace: float) -> AsyncIterator[EngineClient]:
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


def _meets_the_protocol(engine: Engine, client: ProcessEngine) -> list[EngineClient]:
    return [engine, client]  # mypy checks that both are EngineClients
