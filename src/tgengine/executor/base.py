"""The interface the EngineLoop sees (``Executor``: one ``run()`` plus step and memory
calls), and what an executor builds each rank's agent with (``AgentFactory``)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats, ModelAgent
from ..config import EngineConfig
from ..core.step import StepBatch, StepResult
from ..models import ModelConfig
from ..runtime.parallel import ParallelContext


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


class AgentFactory(Protocol):
    """Builds one rank's agent; ``ModelAgent`` itself is the one every executor uses unless
    given another (a test passes a wrapped agent; for worker processes and Ray actors it
    must pickle, by reference)."""

    def __call__(
        self,
        config: EngineConfig,
        *,
        parallel: ParallelContext | None = None,
        model_config: ModelConfig | None = None,
    ) -> ModelAgent: ...


@runtime_checkable
class StagesWeights(Protocol):
    """An executor that can take a weight update while its weights sleep: the tensors wait
    for the next ``wakeup("weights")``, which builds the weights from them (``UniExecutor``)
    or applies them once the weights are back (``MPExecutor``)."""

    async def stage_weights(self, named: list[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class AbsorbsParts(Protocol):
    """An executor that packs a weight update's parts as they arrive while its weights sleep
    at level 2 (``UniExecutor``; ``agent.packed_parts``), so that the parts need not wait
    whole for the commit: ``absorb_part`` returns the names it took, ``settle_absorbed``
    commits them, ``drop_absorbed`` forgets them."""

    async def absorb_part(self, named: list[tuple[str, torch.Tensor]]) -> list[str]: ...

    async def settle_absorbed(self, names: list[str]) -> None: ...

    async def drop_absorbed(self) -> None: ...
