"""Faults for tests, injected the way httpx's tests swap in a ``MockTransport``: the engine
gets a wrapped ``ModelAgent`` (``FaultyAgent``) that raises, hangs, or finds one request's
KV cache not ready at a chosen forward step. The engine's own code knows nothing of it.

Step numbers count forward steps from 1. Where the agent runs decides the seam:

- in this process (``uni``): ``faulty_engine`` gives the engine a ``UniExecutor`` whose
  agent consults the test's ``FaultInjector`` itself;
- in worker processes or Ray actors (``mp``, ``ray``): every rank builds its agent with
  ``PlannedAgents`` (it pickles by reference: conftest puts this directory on their path),
  and ``PlanningExecutor`` wraps the engine's executor: before each step it counts the step
  here (the count the test reads) and writes the injector's ``FaultPlan`` to a file that
  every rank's agent reads before its step;
- in an engine process: ``ProcessEngine(config, executor_factory=InjectedExecutors(plan))``;
  the child's agent follows the plan taken then, counting its own steps.
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import torch

from tgengine import Engine, EngineConfig
from tgengine.agent.agent import AgentInfo, MemoryStats, ModelAgent
from tgengine.core.step import SeqStep, StepBatch, StepResult
from tgengine.executor import Executor, UniExecutor
from tgengine.models import ModelConfig
from tgengine.runtime.parallel import ParallelContext

CACHE_FAULT = "injected fault: cache not ready"


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
    """What a test arms; ``ranks``: the tensor-parallel ranks the faults apply to (None:
    every rank)."""

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
    def from_plan(cls, plan: FaultPlan) -> FaultInjector:
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


class FaultyAgent(ModelAgent):
    """A ``ModelAgent`` that consults ``faults`` before each step and for each sequence.

    ``plan_file``: the agent is a rank in another process; before each step it follows
    the plan written there (none while the file is absent).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        faults: FaultInjector,
        plan_file: str | None = None,
        parallel: ParallelContext | None = None,
        model_config: ModelConfig | None = None,
    ) -> None:
        super().__init__(config, parallel=parallel, model_config=model_config)
        self.faults = faults
        self.plan_file = plan_file
        self._step_number = 0

    def _step(self, batch: StepBatch) -> StepResult:
        with self._stepping():  # a wedged fault is a step in flight to the clean-up
            if self.plan_file is not None:
                plan, num_steps = read_plan(self.plan_file, self.faults.num_steps)
                self.faults.follow(plan, rank=self.parallel.rank, num_steps=num_steps)
            self._step_number = self.faults.before_step()
            return super()._step(batch)

    def _cache_problem(self, seq: SeqStep) -> str | None:
        problem = super()._cache_problem(seq)
        if problem is None and self.faults.is_cache_not_ready(self._step_number, seq.seq_id):
            return CACHE_FAULT
        return problem


def write_plan(path: str, plan: FaultPlan, num_steps: int) -> None:
    """Replace the plan at ``path`` at once (a rank never reads half of one)."""
    scratch = f"{path}.{os.getpid()}.new"
    with open(scratch, "wb") as f:
        pickle.dump((plan, num_steps), f)
    os.replace(scratch, path)


def read_plan(path: str, num_steps: int) -> tuple[FaultPlan, int]:
    """The plan at ``path`` and the steps before this one; no faults while it is absent."""
    try:
        with open(path, "rb") as f:
            plan, steps = pickle.load(f)
    except FileNotFoundError:
        return FaultPlan(), num_steps
    return plan, steps


def remove_plan(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def new_plan_file() -> str:
    fd, path = tempfile.mkstemp(prefix="tgengine-faults-")
    os.close(fd)
    os.unlink(path)  # absent until the first plan
    return path


@dataclass(frozen=True)
class PlannedAgents:
    """An ``AgentFactory`` for ranks in other processes: each follows ``plan_file``."""

    plan_file: str

    def __call__(
        self,
        config: EngineConfig,
        *,
        parallel: ParallelContext | None = None,
        model_config: ModelConfig | None = None,
    ) -> ModelAgent:
        return FaultyAgent(
            config,
            faults=FaultInjector(),
            plan_file=self.plan_file,
            parallel=parallel,
            model_config=model_config,
        )


class PlanningExecutor:
    """Wraps an ``mp`` or ``ray`` executor whose ranks follow ``plan_file``: before each
    step it counts the step (``faults.num_steps``) and writes ``faults``' plan there."""

    def __init__(self, inner: Any, faults: FaultInjector, plan_file: str) -> None:
        self.inner = inner
        self.faults = faults
        self.plan_file = plan_file

    def __getattr__(self, name: str) -> Any:  # pids, timings, agent_factory, ...
        return getattr(self.inner, name)

    def prepare(self) -> None:
        self.inner.prepare()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await self.inner.run(task_status=task_status)
        finally:
            remove_plan(self.plan_file)

    async def execute(self, batch: StepBatch) -> StepResult:
        self._publish()
        result: StepResult = await self.inner.execute(batch)
        return result

    def _publish(self) -> None:
        self.faults.num_steps += 1  # the test reads the count here
        write_plan(self.plan_file, self.faults.plan(), self.faults.num_steps - 1)

    async def sleep(self, level: int) -> None:
        await self.inner.sleep(level)

    async def wakeup(self, tag: str) -> bool:
        reloaded: bool = await self.inner.wakeup(tag)
        return reloaded

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        await self.inner.update_weights(named)

    def memory_stats(self) -> dict[str, MemoryStats]:
        stats: dict[str, MemoryStats] = self.inner.memory_stats()
        return stats


def faulty_executor(config: EngineConfig, faults: FaultInjector) -> Executor:
    """The executor ``config`` asks for, with every rank's agent following ``faults``."""
    kind = config.executor_kind
    if kind == "uni":
        return UniExecutor(config, agent_factory=functools.partial(FaultyAgent, faults=faults))
    plan_file = new_plan_file()
    agents = PlannedAgents(plan_file)
    if kind == "mp":
        from tgengine.executor.mp_executor import MPExecutor

        return PlanningExecutor(MPExecutor(config, agent_factory=agents), faults, plan_file)
    from tgengine.executor.ray_executor import RayExecutor

    return PlanningExecutor(RayExecutor(config, agent_factory=agents), faults, plan_file)


def faulty_engine(config: EngineConfig, faults: FaultInjector) -> Engine:
    """``Engine(config)`` whose agents follow ``faults``."""
    return Engine(config, executor=faulty_executor(config, faults))


@dataclass(frozen=True)
class InjectedExecutors:
    """For ``ProcessEngine(config, executor_factory=...)``: the engine process's agent
    follows ``plan`` (taken when the test made it), counting its own steps."""

    plan: FaultPlan

    def __call__(self, config: EngineConfig) -> Executor:
        faults = FaultInjector.from_plan(self.plan)
        return UniExecutor(config, agent_factory=functools.partial(FaultyAgent, faults=faults))
