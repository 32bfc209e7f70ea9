"""The RL cycle against any ``EngineClient``: rollouts, sleep, train, wake, push.

One cycle, in order (each call and why: docs/rl.md):

1. ``generate`` every prompt with ``SamplingParams(n=..., logprobs=0)``: ``n`` samples per
   prompt, each token with the engine's log probability and each chunk with the
   ``weight_version`` it came from;
2. rewards and group-normalised advantages;
3. ``sleep(level)``: the KV cache goes (and at level 2 the weights), the trainer steps;
4. ``wakeup(["weights"])``, the trainer's tensors pushed in parts (``weight_update()``, one
   part a layer; ``update_weights`` for an engine in another process), ``wakeup(["kv_cache"])``.

Every cycle runs under ``fail_after(cycle_timeout)``: a hang is an error, never a stall. An
engine that dies (``EngineDeadError``, from ``generate`` or as an ``"error"`` chunk of a
dead engine) ends the loop, unless the engine restarts itself (an ``EngineSupervisor``):
then the loop waits for the new engine, pushes the trainer's weights again (the new
engine starts from the model directory's) and carries on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import anyio

from ...engine.client import EngineClient
from ...errors import EngineDeadError
from ...sampling import SamplingParams
from ...state import EngineState
from .grpo import Sample, StepStats, Trainer, group_advantages

RewardFn = Callable[[int, int, Sample], float]  # (step, prompt index, sample) -> reward


class RolloutError(RuntimeError):
    """A rollout's request ended with an ``"error"`` chunk while the engine lives."""


def process_counts() -> dict[str, int]:
    """This process's open file descriptors and threads (the soak checks they stay flat)."""
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
    return {"open_fds": fds, "threads": threading.active_count(), "os_threads": _os_threads()}


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _rss() -> int:
    from ...agent.host_memory import process_rss

    return process_rss()[0]


@dataclass
class CycleStats:
    """One cycle's figures: rewards, agreement, versions, seconds and memory per phase."""

    step: int  # the trainer's step after this cycle
    mean_reward: float
    rewards: list[float]
    num_tokens: int
    engine_logprob_mean: float
    train: StepStats
    weight_versions: list[int]  # every distinct version the cycle's chunks carried
    expected_version: int  # the engine's version the cycle's rollouts should carry
    seconds: dict[str, float] = field(default_factory=dict)
    rss_bytes: dict[str, int] = field(default_factory=dict)  # this process, after each phase
    engine_memory: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    num_restarts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RLLoop:
    """Drives ``engine`` and ``trainer`` through cycles; see the module docstring.

    ``prompts(step)`` gives the token ids of the cycle's prompts, ``reward(step, i,
    sample)`` scores a sample of prompt ``i``.
    """

    def __init__(
        self,
        engine: EngineClient,
        trainer: Trainer,
        prompts: Callable[[int], Sequence[list[int]]],
        reward: RewardFn,
        params: SamplingParams,
        *,
        sleep_level: int = 1,
        cycle_timeout: float = 600.0,
        restart_timeout: float = 120.0,
    ) -> None:
        if params.logprobs is None:
            raise ValueError("params: the loop needs logprobs=0 (or more)")
        self.engine = engine
        self.trainer = trainer
        self.prompts = prompts
        self.reward = reward
        self.params = params
        self.sleep_level = sleep_level
        self.cycle_timeout = cycle_timeout
        self.restart_timeout = restart_timeout
        # The engine's weight_version that matches the trainer's step: it counts updates
        # (and level-2 reloads), and a restarted engine counts from 0 again.
        self.expected_version = engine.weight_version
        self.num_restarts = 0
        self.restore_seconds: list[float] = []  # each restore: the wait and the re-push
        self._restarts_seen = getattr(engine, "num_restarts", 0)

    async def cycles(self, num_steps: int) -> AsyncIterator[CycleStats]:
        """Run until the trainer has taken ``num_steps`` steps; yield each cycle's stats.

        Raises ``TimeoutError`` when a cycle exceeds ``cycle_timeout``, and
        ``EngineDeadError`` when the engine dies and does not restart itself.
        """
        while self.trainer.step < num_steps:
            try:
                with anyio.fail_after(self.cycle_timeout):
                    stats = await self.cycle()
            except EngineDeadError:
                if not hasattr(self.engine, "wait_serving"):  # it will not come back
                    raise
                await self.restore()
                continue
            yield stats

    async def restore(self) -> None:
        """Wait for the restarted engine, then push the trainer's weights to it again."""
        engine: Any = self.engine
        start = time.perf_counter()
        with anyio.fail_after(self.restart_timeout):
            await engine.wait_serving(self._restarts_seen + 1)
            self._restarts_seen = engine.num_restarts
            await push_weights(self.engine, self.trainer.trained_weights())
        self.num_restarts += 1
        self.restore_seconds.append(time.perf_counter() - start)
        self.expected_version = self.engine.weight_version

    async def cycle(self) -> CycleStats:
        """One cycle: rollouts, advantages, sleep, one trainer step, wake, push."""
        seconds: dict[str, float] = {}
        rss: dict[str, int] = {}
        memory: dict[str, dict[str, Any]] = {}

        def mark(phase: str, start: float) -> float:
            now = time.perf_counter()
            seconds[phase] = now - start
            rss[phase] = _rss()
            memory[phase] = {d: asdict(s) for d, s in self.engine.memory_stats().items()}
            return now

        t = time.perf_counter()
        groups = await self.scored_rollout()
        t = mark("generate", t)
        await self.engine.sleep(self.sleep_level)
        t = mark("sleep", t)
        train = await anyio.to_thread.run_sync(self.trainer.train_step, groups)
        t = mark("train", t)
        await self.engine.wakeup(["weights"])
        t = mark("wakeup weights", t)
        await push_weights(self.engine, self.trainer.trained_weights())
        t = mark("push", t)
        await self.engine.wakeup(["kv_cache"])
        mark("wakeup kv_cache", t)
        expected = self.expected_version
        self.expected_version = self.engine.weight_version
        samples = [s for g in groups for s in g]
        logps = [lp for s in samples for lp in s.logprobs]
        return CycleStats(
            step=self.trainer.step,
            mean_reward=sum(s.reward for s in samples) / len(samples),
            rewards=[s.reward for s in samples],
            num_tokens=sum(len(s.token_ids) for s in samples),
            engine_logprob_mean=sum(logps) / max(1, len(logps)),
            train=train,
            weight_versions=sorted(set().union(*(s.weight_versions for s in samples))),
            expected_version=expected,
            seconds=seconds,
            rss_bytes=rss,
            engine_memory=memory,
            counts=process_counts(),
            num_restarts=self.num_restarts,
        )

    async def scored_rollout(self) -> list[list[Sample]]:
        """The step's rollouts with rewards and advantages (the engine must be awake)."""
        step = self.trainer.step
        groups = await self.rollout(self.prompts(step))
        for i, group in enumerate(groups):
            for sample in group:
                sample.reward = self.reward(step, i, sample)
            advantages = group_advantages([s.reward for s in group])
            for sample, adv in zip(group, advantages, strict=True):
                sample.advantage = adv
        return groups

    async def evaluate(self) -> dict[str, Any]:
        """A rollout with the current weights, scored, without training (the closing figure)."""
        with anyio.fail_after(self.cycle_timeout):
            groups = await self.scored_rollout()
        rewards = [s.reward for g in groups for s in g]
        return {
            "step": self.trainer.step,
            "mean_reward": sum(rewards) / len(rewards),
            "rewards": rewards,
        }

    async def rollout(self, prompts: Sequence[list[int]]) -> list[list[Sample]]:
        """``params.n`` samples of each prompt, all prompts at once."""
        groups = [[Sample(list(p)) for _ in range(self.params.n)] for p in prompts]
        step = self.trainer.step

        async def one(i: int) -> None:
            params = self.params
            if params.seed is not None:  # a different draw every step and prompt
                params = replace(params, seed=params.seed + 1000 * step + 64 * i)
            async for chunk in self.engine.generate(groups[i][0].prompt_ids, params):
                sample = groups[i][chunk.index]
                if chunk.token_ids:
                    sample.token_ids += chunk.token_ids
                    sample.logprobs += chunk.logprobs or []
                    sample.weight_versions.add(chunk.weight_version)
                if chunk.finish_reason == "error":
                    if self.engine.state is EngineState.DEAD:
                        raise EngineDeadError(f"rollout ended: {chunk.error}")
                    raise RolloutError(f"rollout {chunk.request_id} ended: {chunk.error}")
                if chunk.finish_reason:
                    sample.finish_reason = chunk.finish_reason

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        except BaseExceptionGroup as group:
            dead = group.subgroup(EngineDeadError)
            if dead is not None:  # one death is every rollout's: report it once
                raise _first(dead) from _first(dead).__cause__
            raise
        return groups


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def push_weights(engine: EngineClient, named: Sequence[tuple[str, Any]]) -> None:
    """Push the trainer's tensors, in parts: one a decoder layer, through
    ``engine.weight_update()`` (each part checked as it arrives, all applied at once at the
    end of the block; for an engine in another process each part crosses /dev/shm)."""
    async with engine.weight_update() as update:
        for part in layer_parts(named):
            await update.push(part)


def layer_parts(named: Sequence[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """``named`` grouped by decoder layer (``model.layers.N.``), other tensors one each."""
    parts: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in named:
        head = name.split(".")[:3]
        key = ".".join(head) if head[1:2] == ["layers"] else name
        parts.setdefault(key, []).append((name, tensor))
    return list(parts.values())
