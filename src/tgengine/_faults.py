"""A fault-injection seam for tests; not a public feature.

The ModelAgent consults a ``FaultInjector`` only when one was passed in, so production
code pays one ``is not None`` check per step. Step numbers count forward steps from 1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class FaultInjector:
    raise_at: dict[int, BaseException] = field(default_factory=dict)
    hang_at: set[int] = field(default_factory=set)
    cache_not_ready_at: dict[int, set[str]] = field(default_factory=dict)
    hang_limit: float = 60.0
    num_steps: int = 0
    hanging: threading.Event = field(default_factory=threading.Event)
    hang_returned: threading.Event = field(default_factory=threading.Event)
    _release: threading.Event = field(default_factory=threading.Event)

    def before_step(self) -> int:
        """Called in the worker thread before each forward step; may raise or hang."""
        self.num_steps += 1
        step = self.num_steps
        if step in self.hang_at:
            self.hanging.set()
            self._release.wait(self.hang_limit)
            self.hang_returned.set()
        if step in self.raise_at:
            raise self.raise_at[step]
        return step

    def is_cache_not_ready(self, step: int, request_id: str) -> bool:
        return request_id in self.cache_not_ready_at.get(step, ())

    def release(self) -> None:
        """Let every injected hang return."""
        self._release.set()
