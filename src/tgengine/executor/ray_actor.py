"""``RankActor``: the Ray actor that holds one tensor-parallel rank.

An async actor: every method is a coroutine on the actor's own event loop. ``serve()``
runs the rank's ``RankWorker`` (the same command handling as the ``mp`` executor's worker
processes) under its own ``run()`` for the life of the actor, while ``handle()`` passes
each command to it. ``serve()`` never returns while the rank runs: the executor awaits it
as the rank's liveness (it fails when the agent fails, and Ray fails it when the actor or
its node is lost).
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import torch

from ..agent.agent import AgentInfo, MemoryStats
from ..runtime.parallel import free_port
from .worker import CheckWeights, Command, RankSpec, RankWorker, UpdateWeights

# Ray options of a rank actor: never restarted, calls never retried (a lost rank is a fault).
ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0, "max_concurrency": 64}


class RankActor:
    """One rank: ``serve(spec)`` first, then ``ready()``; ``handle()`` once ready."""

    def __init__(self) -> None:
        self._worker: RankWorker | None = None
        self._info: AgentInfo | None = None
        self._error: BaseException | None = None
        self._ready: anyio.Event | None = None

    async def whereabouts(self) -> tuple[str, str, int]:
        """This actor's Ray node id, that node's IP address, and this process's id."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return node_id, ray.util.get_node_ip_address(), os.getpid()

    async def free_port(self) -> int:
        """A TCP port free on this actor's machine (for the group's rendezvous)."""
        return free_port()

    async def serve(self, spec: RankSpec) -> None:
        """Join the group, load this rank's shard, then hold it; returns only if it fails."""
        ready = self._ready_event()
        worker = RankWorker(spec)
        try:
            async with anyio.create_task_group() as tg:
                self._info = await tg.start(worker.run)
                self._worker = worker
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

    async def handle(self, command: Command) -> Any:
        return await self._serving().handle(command)

    async def handle_weights(self, update: bool, named: list[tuple[str, torch.Tensor]]) -> None:
        """``CheckWeights`` (or, ``update``, ``UpdateWeights``) of tensors that reach every
        rank once, through Ray's object store."""
        command = UpdateWeights(named) if update else CheckWeights(named)
        await self._serving().handle(command)

    async def memory_stats(self) -> dict[str, MemoryStats]:
        return self._serving().memory_stats()

    def _serving(self) -> RankWorker:
        if self._worker is None:
            raise RuntimeError("this rank is not serving")
        return self._worker

    def _ready_event(self) -> anyio.Event:
        if self._ready is None:  # made on the actor's event loop, by whichever call is first
            self._ready = anyio.Event()
        return self._ready
