"""``HealthMonitor``: is the engine serving *and making progress*?

A state flag is not enough: a forward step that never returns leaves the state at
``running``. So the monitor also asks whether the step loop has moved recently while
there was runnable work. Work that appeared after a long idle period is measured from
when the monitor first saw it, not from the (old) last step.
"""

from __future__ import annotations

import anyio

from ..engine.client import EngineClient
from ..state import EngineState
from .protocol import HealthResponse

SERVING = (EngineState.RUNNING, EngineState.PAUSED, EngineState.SLEEPING)


class HealthMonitor:
    """Computes ``/health`` from the engine's state and its step progress."""

    def __init__(self, engine: EngineClient, stall_seconds: float) -> None:
        self.engine = engine
        self.stall_seconds = stall_seconds
        self._busy_since: float | None = None

    def check(self) -> HealthResponse:
        """200-worthy (``status="ok"``) while serving and not stalled; sleeping is alive."""
        engine = self.engine
        stats = engine.stats()
        now = anyio.current_time()
        busy = engine.state is EngineState.RUNNING and stats.num_running + stats.num_waiting > 0
        if not busy:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now
        age: float | None = None
        if busy:
            assert self._busy_since is not None
            last = max(stats.last_step_time or self._busy_since, self._busy_since)
            age = now - last
        stalled = age is not None and age > self.stall_seconds
        ok = engine.state in SERVING and not stalled
        return HealthResponse(
            status="ok" if ok else "unavailable",
            state=str(engine.state),
            stalled=stalled,
            sleeping_tags=sorted(engine.sleeping_tags),
            seconds_since_progress=age,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            weight_version=stats.weight_version,
        )
