"""``RankWorker``: the Ray actor that holds one tensor-parallel rank.

It is an async actor: every method is a coroutine on the actor's own event loop, so
``serve()`` can hold a ``ModelAgent`` under the agent's own ``run()`` for the life of the
actor while ``execute()`` and the control calls reach the same agent. ``serve()`` never
returns while the agent runs: the executor awaits it as the rank's liveness (it fails when
the agent fails, and Ray fails it when the actor or its node is lost).
"""

from __future__ import annotations

from typing import Any

import anyio
import torch

from .._faults import FaultInjector, FaultPlan
from ..config import EngineConfig
from ..model_agent import AgentInfo, MemoryStats, ModelAgent
from ..parallel import ParallelContext, free_port, init_distributed
from ..step import StepBatch, StepResult


class RankWorker:
    """One rank: ``serve()`` first, then ``ready()``; the rest once ready."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self._faults: FaultInjector | None = None
        self._agent: ModelAgent | None = None
        self._info: AgentInfo | None = None
        self._error: BaseException | None = None
        self._ready: anyio.Event | None = None

    async def rendezvous_address(self) -> str:
        """``tcp://HOST:PORT`` for the group's rendezvous, on this (rank 0's) node."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    async def serve(self, init_method: str, faults: FaultPlan | None = None) -> None:
        """Join the group, load this rank's shard, then hold it; returns only if it fails."""
        ready = self._ready_event()
        try:
            parallel = ParallelContext()
            if self.world_size > 1:
                parallel = await anyio.to_thread.run_sync(
                    init_distributed, self.rank, self.world_size, init_method, _device_type(self)
                )
            if faults is not None:
                self._faults = FaultInjector()
                self._faults.follow(faults, rank=self.rank, num_steps=0)
            self._agent = ModelAgent(self.config, self._faults, parallel=parallel)
            async with anyio.create_task_group() as tg:
                self._info = await tg.start(self._agent.run)
                ready.set()
        except BaseException as exc:
            self._error = exc
            ready.set()
            raise

    async def ready(self) -> AgentInfo:
        """This rank's ``AgentInfo`` once loaded; ``serve()``'s error if loading failed."""
        await self._ready_event().wait()
        if self._error is not None:
            raise self._error
        assert self._info is not None
        return self._info

    async def follow_faults(self, plan: FaultPlan, num_steps: int) -> None:
        """Tests only: take the test's fault plan (see ``FaultInjector.follow``)."""
        if self._faults is not None:
            self._faults.follow(plan, rank=self.rank, num_steps=num_steps)

    async def execute(self, batch: StepBatch) -> StepResult:
        return await self._running().execute(batch)

    async def sleep(self, level: int) -> None:
        await self._running().sleep(level)

    async def wakeup(self, tag: str) -> bool:
        return await self._running().wakeup(tag)

    async def check_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        await self._running().check_weights(named)

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        await self._running().update_weights(named)

    async def memory_stats(self) -> dict[str, MemoryStats]:
        return self._running().memory_stats()

    async def whereabouts(self) -> tuple[str, int]:
        """This actor's Ray node id and process id."""
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def _running(self) -> ModelAgent:
        if self._agent is None or self._info is None:
            raise RuntimeError(f"rank {self.rank} is not serving")
        return self._agent

    def _ready_event(self) -> anyio.Event:
        if self._ready is None:  # made on the actor's event loop, by whichever call is first
            self._ready = anyio.Event()
        return self._ready


def _device_type(worker: RankWorker) -> str:
    device = worker.config.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def actor_options(**options: Any) -> dict[str, Any]:
    """Ray options of a rank actor: async (one event loop), never restarted, never retried."""
    return {"max_restarts": 0, "max_task_retries": 0, "max_concurrency": 64, **options}
