"""A fault-injection seam for tests; not a public feature.

The ModelAgent consults a ``FaultInjector`` only when one was passed in, so production
code pays one ``is not None`` check per step. Step numbers count forward steps from 1.
An agent in another process (an engine process, or an executor's worker) follows the
test's injector through a ``FaultPlan``, its picklable part.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultPlan:
    """The picklable part of a ``FaultInjector`` (steps to raise at, hang in, fail a cache)."""

    raise_at: dict[int, BaseException] = field(default_factory=dict)
    hang_at: set[int] = field(default_factory=set)
    cache_not_ready_at: dict[int, set[str]] = field(default_factory=dict)
    hang_limit: float = 60.0
    ranks: frozenset[int] | None = None


@dataclass
class FaultInjector:
    """``ranks``: the tensor-parallel ranks the faults apply to (None: every rank)."""

    raise_at: dict[int, BaseException] = field(default_factory=dict)
    hang_at: set[int] = field(default_factory=set)
    cache_not_ready_at: dict[int, set[str]] = field(default_factory=dict)
    hang_limit: float = 60.0
    ranks: set[int] | None = None
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

    def plan(self) -> FaultPlan:
        """What another process needs to follow this injector (a copy, taken now)."""
        return FaultPlan(
            raise_at=dict(self.raise_at),
            hang_at=set(self.hang_at),
            cache_not_ready_at={k: set(v) for k, v in self.cache_not_ready_at.items()},
            hang_limit=self.hang_limit,
            ranks=None if self.ranks is None else frozenset(self.ranks),
        )

    @classmethod
    def from_plan(cls, plan: FaultPlan | None) -> FaultInjector | None:
        if plan is None:
            return None
        return cls(
            raise_at=dict(plan.raise_at),
            hang_at=set(plan.hang_at),
            cache_not_ready_at={k: set(v) for k, v in plan.cache_not_ready_at.items()},
            hang_limit=plan.hang_limit,
            ranks=None if plan.ranks is None else set(plan.ranks),
        )

    def follow(self, plan: FaultPlan, *, rank: int, num_steps: int) -> None:
        """Take ``plan`` for rank ``rank`` (nothing when it names other ranks), with
        ``num_steps`` steps done so far (the test's count, kept in the test's process)."""
        mine = plan.ranks is None or rank in plan.ranks
        self.raise_at = dict(plan.raise_at) if mine else {}
        self.hang_at = set(plan.hang_at) if mine else set()
        self.cache_not_ready_at = (
            {k: set(v) for k, v in plan.cache_not_ready_at.items()} if mine else {}
        )
        self.hang_limit = plan.hang_limit
        self.num_steps = num_steps
