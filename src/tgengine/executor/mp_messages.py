"""The messages between ``MPExecutor`` and its worker processes (``mp_worker``).

Parent → worker: a ``RankSpec`` (first, once), then ``Request``s. Worker → parent:
``Loaded`` once the rank can serve (or ``Fatal``), then one ``Response`` per request, in
order; ``Fatal`` if the rank fails outside a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..agent.agent import AgentInfo, MemoryStats
from .worker import Command


@dataclass(frozen=True)
class Request:
    call_id: int
    command: Command


@dataclass(frozen=True)
class Response:
    """``result`` of the command, or its ``error``; ``memory``: the rank's figures when
    they may have changed (after a control command, and at most every half second);
    ``elapsed``: seconds the rank spent on the command (the rest is transport)."""

    call_id: int
    result: Any = None
    error: BaseException | None = None
    memory: dict[str, MemoryStats] | None = None
    elapsed: float = 0.0


@dataclass(frozen=True)
class Loaded:
    info: AgentInfo
    pid: int
    memory: dict[str, MemoryStats]


@dataclass(frozen=True)
class Fatal:
    """The rank failed (while loading, or its agent ended); the process exits next."""

    error: BaseException
