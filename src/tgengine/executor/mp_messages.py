"""The messages between ``MPExecutor`` and its worker processes (``mp_worker``).

Parent → worker: a ``RankSpec`` (first, once), then ``ipc.calls.Request``s, each holding
one ``worker.Command``. Worker → parent: ``Loaded`` once the rank can serve (or
``Fatal``), then one ``ipc.calls.Reply`` per request, in order, each after a ``Memory``
when the rank's figures may have changed (after a control command, and at most every half
second); ``Fatal`` if the rank fails outside a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..agent.agent import AgentInfo, MemoryStats


@dataclass(frozen=True)
class Loaded:
    info: AgentInfo
    pid: int
    memory: dict[str, MemoryStats]


@dataclass(frozen=True)
class Memory:
    """The rank's memory figures, as of now."""

    stats: dict[str, MemoryStats]


@dataclass(frozen=True)
class Fatal:
    """The rank failed (while loading, or its agent ended); the process exits next."""

    error: BaseException
