"""One rank of a multi-process or Ray executor: its ``ModelAgent`` and the commands it obeys.

Transport-free: the ``mp`` executor's worker process and the ``ray`` executor's actor
both build a ``RankWorker`` from a ``RankSpec``, run ``RankWorker.run()`` (it joins the
tensor-parallel group and runs the agent's own ``run()``), and pass each command they
receive to ``RankWorker.handle()``, whose return value (or exception) is the reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats, ModelAgent
from ..config import EngineConfig
from ..core.step import StepBatch, StepResult
from ..ipc.weights_file import map_weights, read_weights
from ..models import ModelConfig
from ..runtime.parallel import ParallelContext, destroy_distributed, init_distributed
from .base import AgentFactory

LEAVE_GROUP_TIMEOUT = 2.0  # seconds; a peer that died can wedge the group's teardown

# A directory of safetensors (the same machine: mp writes one in /dev/shm) or the tensors.
WeightsSource = str | list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start: what to load and where it sits in the group.

    ``init_method`` is the group's rendezvous (``tcp://127.0.0.1:PORT`` on one machine);
    None at ``world_size`` 1. ``model_config``: config.json as the executor read it (None:
    the rank reads it; that imports transformers, seconds of a worker's start).
    ``agent_factory`` builds the rank's agent (it crosses to the rank by reference).
    """

    config: EngineConfig
    rank: int
    world_size: int
    init_method: str | None = None
    model_config: ModelConfig | None = None
    agent_factory: AgentFactory = ModelAgent


@dataclass(frozen=True)
class Execute:
    """One forward step."""

    batch: StepBatch


@dataclass(frozen=True)
class Sleep:
    level: int


@dataclass(frozen=True)
class Wakeup:
    """``staged``: weights files committed while the weights slept, in commit order; the
    weights wake from them (as ``ModelAgent.stage_weights`` then ``wakeup`` would), and
    only what they do not hold is read from the model directory."""

    tag: str
    staged: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckWeights:
    """Validate full tensors on this rank; changes nothing (raises ``InvalidRequestError``)."""

    source: WeightsSource


@dataclass(frozen=True)
class UpdateWeights:
    """Take this rank's shard of the full tensors; sent only once every rank passed
    ``CheckWeights``."""

    source: WeightsSource


@dataclass(frozen=True)
class GetMemoryStats:
    pass


Command = Execute | Sleep | Wakeup | CheckWeights | UpdateWeights | GetMemoryStats


class RankWorker:
    """Holds one rank's agent while ``run()`` runs and answers ``handle(command)``.

    Replies: ``Execute`` → ``StepResult`` (only rank 0's tokens count); ``Wakeup`` →
    True when any weight was read from the model directory; ``GetMemoryStats`` →
    ``memory_stats()``; the others → None.
    """

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self._agent: ModelAgent | None = None
        self._weights: tuple[str, list[tuple[str, torch.Tensor]]] | None = None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Join the group, load this rank's shard, ``started(info)``; returns only when
        cancelled (the agent releases its memory first)."""
        spec = self.spec
        parallel = ParallelContext()
        if spec.world_size > 1:
            assert spec.init_method is not None, "a group of several ranks needs a rendezvous"
            timeout = spec.config.step_timeout
            parallel = await anyio.to_thread.run_sync(
                init_distributed,
                spec.rank,
                spec.world_size,
                spec.init_method,
                _device_type(spec.config.device),
                timeout,
                abandon_on_cancel=True,
            )
        try:
            self._agent = spec.agent_factory(
                spec.config, parallel=parallel, model_config=spec.model_config
            )
            async with anyio.create_task_group() as tg:
                info = await tg.start(self._agent.run)
                task_status.started(info)
        finally:
            self._agent = None
            if parallel.is_parallel:
                with anyio.move_on_after(LEAVE_GROUP_TIMEOUT, shield=True):
                    await anyio.to_thread.run_sync(destroy_distributed, abandon_on_cancel=True)

    async def handle(self, command: Command) -> Any:
        """Carry out ``command`` on this rank; see the class docstring for the replies."""
        agent = self._agent
        if agent is None:
            raise RuntimeError(f"rank {self.spec.rank} is not running")
        if not isinstance(command, (CheckWeights, UpdateWeights)):
            self._weights = None  # a check that failed elsewhere: let go of its tensors
        match command:
            case Execute(batch):
                result: StepResult = await agent.execute(batch)
                return result
            case Sleep(level):
                await agent.sleep(level)
            case Wakeup(tag, staged):
                for path in staged:
                    await agent.stage_weights(await self._staged(path))
                return await agent.wakeup(tag)
            case CheckWeights(source):
                await agent.check_weights(await self._named(source))
            case UpdateWeights(source):
                named = await self._named(source)
                self._weights = None
                await agent.update_weights(named)
            case GetMemoryStats():
                return self.memory_stats()
            case _:
                raise TypeError(f"not a worker command: {type(command).__name__}")
        return None

    def memory_stats(self) -> dict[str, MemoryStats]:
        """This rank's figures; keyed ``rank{r}:{device}`` in a group of several ranks."""
        agent = self._agent
        stats = agent.memory_stats() if agent is not None else {}
        if self.spec.world_size == 1:
            return stats
        return {f"rank{self.spec.rank}:{device}": s for device, s in stats.items()}

    async def _staged(self, path: str) -> list[tuple[str, torch.Tensor]]:
        """A staged file's tensors: read into this process's memory where they may become
        the weights themselves (one rank), else mapped (each rank copies its shard)."""
        if self.spec.world_size == 1:
            named, _ = await anyio.to_thread.run_sync(read_weights, path)
            return named
        return await anyio.to_thread.run_sync(map_weights, path)

    async def _named(self, source: WeightsSource) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``source``; a directory is mapped once for the check and the update.

        Mapped, not read: the tensors are views of the shared file, so the check reads no
        data and the update copies only this rank's shard of each into its parameters.
        """
        if not isinstance(source, str):
            return source
        if self._weights is None or self._weights[0] != source:
            named = await anyio.to_thread.run_sync(map_weights, source)
            self._weights = (source, named)
        return self._weights[1]


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type
