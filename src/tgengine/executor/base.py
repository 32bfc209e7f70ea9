"""The interface the EngineLoop sees: one ``run()`` plus step and memory calls."""

from __future__ import annotations

from typing import Protocol

import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats
from ..core.step import StepBatch, StepResult


class Executor(Protocol):
    def prepare(self) -> None:
        """Blocking set-up that must not share the CPU (thread-count timing); ``run`` does it
        if nobody did. The engine calls it in a worker thread before starting anything else."""

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the workers; ``started(info)`` once they can serve; returns only when cancelled."""

    async def execute(self, batch: StepBatch) -> StepResult: ...

    async def sleep(self, level: int) -> None: ...

    async def wakeup(self, tag: str) -> bool: ...

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None: ...

    def memory_stats(self) -> dict[str, MemoryStats]: ...
