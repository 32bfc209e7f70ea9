"""The ``mp`` executor's bookkeeping of calls: one broadcast command awaiting every rank's
reply (``Call``), and the step timings the benches read (``StepTimings``)."""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any

import anyio

from ..errors import WorkerExited


@dataclasses.dataclass
class StepTimings:
    """The control plane's share of the steps so far: ``round_trip_s`` is the executor's
    time from sending a step to its last reply, ``worker_s`` the slowest rank's own time."""

    num_steps: int = 0
    round_trip_s: float = 0.0
    worker_s: float = 0.0
    recent: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=10_000)
    )  # each recent step's round trip minus worker time

    def add(self, round_trip: float, worker: float) -> None:
        self.num_steps += 1
        self.round_trip_s += round_trip
        self.worker_s += worker
        self.recent.append(round_trip - worker)

    @property
    def overhead_per_step_s(self) -> float:
        """The mean; on a busy machine the tail (waiting for a core) weighs on it."""
        return (self.round_trip_s - self.worker_s) / self.num_steps if self.num_steps else 0.0

    @property
    def median_overhead_s(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


@dataclasses.dataclass
class Call:
    """One command broadcast to every rank.

    ``done`` at the last reply or the first error; ``settled`` once every rank replied or
    is gone. After an error the caller waits (briefly) for ``settled``: a rank that died
    makes the others fail in a collective, and the dead rank is the cause to report.
    """

    num_ranks: int
    is_step: bool
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    errors: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    elapsed: float = 0.0  # the slowest rank's own time
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    settled: anyio.Event = dataclasses.field(default_factory=anyio.Event)

    def answer(self, rank: int, result: Any, elapsed: float) -> None:
        self.results[rank] = result
        self.elapsed = max(self.elapsed, elapsed)
        self._check()

    def fail(self, rank: int, error: BaseException) -> None:
        self.errors.setdefault(rank, error)
        self.done.set()
        self._check()

    def _check(self) -> None:
        if len(self.results) + len(self.errors) >= self.num_ranks:
            self.done.set()
            self.settled.set()

    @property
    def error(self) -> BaseException | None:
        """A lost rank if any (the others' errors follow from it), else the first error."""
        lost = [e for e in self.errors.values() if isinstance(e, WorkerExited)]
        return lost[0] if lost else next(iter(self.errors.values()), None)
