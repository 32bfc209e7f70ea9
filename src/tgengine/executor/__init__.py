"""Executors run the ModelAgent(s): in this process (``uni``), one worker process per
tensor-parallel rank (``mp``), or one Ray actor per rank (``ray``)."""

from __future__ import annotations

from .._faults import FaultInjector
from ..config import EngineConfig
from .base import Executor
from .errors import WorkerError, WorkerExited, WorkerFailed
from .mp_executor import MPExecutor
from .uni_executor import UniExecutor

__all__ = [
    "Executor",
    "MPExecutor",
    "UniExecutor",
    "WorkerError",
    "WorkerExited",
    "WorkerFailed",
    "make_executor",
]


def make_executor(config: EngineConfig, faults: FaultInjector | None = None) -> Executor:
    """The executor ``config`` asks for (``EngineConfig.executor_kind``); no I/O here."""
    kind = config.executor_kind
    if kind == "uni":
        return UniExecutor(config, faults)
    if kind == "mp":
        return MPExecutor(config, faults)
    from .ray_executor import RayExecutor  # the optional `ray` extra

    return RayExecutor(config, faults)
