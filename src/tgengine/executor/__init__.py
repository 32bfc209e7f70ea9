"""Executors run the ModelAgent(s): in this process (``uni``), one worker process per
tensor-parallel rank (``mp``), or one Ray actor per rank (``ray``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from .base import AgentFactory, Executor
from .uni_executor import UniExecutor

if TYPE_CHECKING:
    from .mp_executor import MPExecutor

__all__ = [
    "AgentFactory",
    "Executor",
    "MPExecutor",
    "UniExecutor",
    "make_executor",
]


def make_executor(config: EngineConfig) -> Executor:
    """The executor ``config`` asks for (``EngineConfig.executor_kind``); no I/O here."""
    kind = config.executor_kind
    if kind == "uni":
        return UniExecutor(config)
    if kind == "mp":
        from .mp_executor import MPExecutor

        return MPExecutor(config)
    from .ray_executor import RayExecutor

    return RayExecutor(config)


def __getattr__(name: str) -> Any:
    # The multi-process executor (and its worker's imports) loads only when asked for.
    if name == "MPExecutor":
        from .mp_executor import MPExecutor

        return MPExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
