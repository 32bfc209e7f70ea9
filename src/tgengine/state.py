"""``EngineState``: the one enum of the engine's lifecycle.

::

    STARTING → RUNNING ⇄ PAUSED ⇄ SLEEPING → STOPPING → STOPPED
    any state → DEAD (a fault)
"""

from __future__ import annotations

import enum

MEMORY_TAGS = ("weights", "kv_cache")


class EngineState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"

    @property
    def is_final(self) -> bool:
        return self in (EngineState.STOPPED, EngineState.DEAD)

    def __str__(self) -> str:
        return self.value
