"""``StepTimings``: the ``mp`` executor's step timings, which the benches read."""

from __future__ import annotations

import collections
import dataclasses
import statistics


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
