"""``UniExecutor``: one ModelAgent in this process."""

from __future__ import annotations

import anyio
import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats, ModelAgent
from ..config import EngineConfig
from ..core.step import StepBatch, StepResult
from .base import AgentFactory


class UniExecutor:
    """Runs a single in-process ModelAgent (``agent_factory(config)``) as its only child."""

    def __init__(self, config: EngineConfig, *, agent_factory: AgentFactory = ModelAgent) -> None:
        self.agent = agent_factory(config)

    def prepare(self) -> None:
        self.agent.prepare()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the agent and pass its info up; returns only when cancelled."""
        async with anyio.create_task_group() as tg:
            info = await tg.start(self.agent.run)
            task_status.started(info)

    async def execute(self, batch: StepBatch) -> StepResult:
        return await self.agent.execute(batch)

    async def sleep(self, level: int) -> None:
        await self.agent.sleep(level)

    async def wakeup(self, tag: str) -> bool:
        return await self.agent.wakeup(tag)

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        await self.agent.update_weights(named)

    async def stage_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        await self.agent.stage_weights(named)

    async def absorb_part(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        return await self.agent.absorb_part(named)

    async def settle_absorbed(self, names: list[str]) -> None:
        await self.agent.settle_absorbed(names)

    async def drop_absorbed(self) -> None:
        await self.agent.drop_absorbed()

    def memory_stats(self) -> dict[str, MemoryStats]:
        return self.agent.memory_stats()
