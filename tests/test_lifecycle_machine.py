"""A hypothesis state machine over a real tiny model: no interleaving of lifecycle calls
breaks the engine's promises, on asyncio and on trio.

The engine runs in a blocking portal (an event loop of the chosen backend in a thread);
each rule is one call into it, bounded by ``fail_after``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tgengine import (
    Engine,
    EnginePausedError,
    EngineSleepingError,
    EngineState,
    EngineStoppedError,
)
from tgengine._faults import FaultInjector
from tgengine.models import iter_safetensors

from engine_helpers import Consumer, collect, engine_threads, greedy, tiny_config, tokens_of

BOUND = 30.0  # seconds: any single call, and the final drain, must finish within it
PROMPTS = [[5, 17, 42, 99], [3, 3, 3, 3, 3, 3, 3, 3, 3, 9], [100, 200, 300], list(range(40, 62))]
S = EngineState


@functools.lru_cache(maxsize=4)
def reference_tokens(model_dir: str, backend: str) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of every (prompt, max_tokens) the machine may ask for, from a fresh engine."""

    async def compute() -> dict[tuple[int, int], list[int]]:
        engine = Engine(tiny_config(Path(model_dir)))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            out = {}
            for i, prompt in enumerate(PROMPTS):
                full = tokens_of(await collect(engine, prompt, greedy(24)))
                for n in range(1, 25):
                    out[(i, n)] = full[:n]
            engine.stop()
        return out

    return anyio.run(compute, backend=backend)


class LifecycleMachine(RuleBasedStateMachine):
    model_dir: Path
    backend: str

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = start_blocking_portal(self.backend)
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self.faults = FaultInjector()
        self.engine = Engine(tiny_config(self.model_dir, num_blocks=48), _faults=self.faults)
        self.run_future, _ = self.portal.start_task(self.engine.run)
        self.expected = S.RUNNING
        self.pause_mode: str | None = None
        self.sleeping: set[str] = set()
        self.consumers: list[tuple[Consumer, int, int, int | None]] = []
        self.uninterrupted: set[int] = set()
        self.weights = list(iter_safetensors(self.model_dir))

    def call(self, fn: Any, *args: Any) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(BOUND):
                return await fn(*args)

        return self.portal.call(bounded)

    # -- requests -------------------------------------------------------------------

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_tokens=st.integers(1, 24),
        break_after=st.none() | st.integers(1, 6),
    )
    def submit(self, prompt: int, max_tokens: int, break_after: int | None) -> None:
        consumer = Consumer(self.engine, PROMPTS[prompt], greedy(max_tokens))

        async def start() -> Any:
            try:
                return self.engine.generate(consumer.prompt, consumer.params)
            except Exception as exc:
                return exc

        stream = self.portal.call(start)
        want = self.admission_error()
        if want is None:
            assert not isinstance(stream, BaseException), stream
            self.start_consumer(consumer, stream, break_after)
            index = len(self.consumers)
            self.consumers.append((consumer, prompt, max_tokens, break_after))
            if break_after is None and self.expected is not S.STOPPED:
                self.uninterrupted.add(index)
        else:
            assert isinstance(stream, want), (stream, want)

    def start_consumer(self, consumer: Consumer, stream: Any, break_after: int | None) -> None:
        async def consume() -> None:
            try:
                async for chunk in stream:
                    consumer.chunks.append(chunk)
                    if break_after is not None and len(consumer.chunks) >= break_after:
                        break
            finally:
                consumer.done.set()

        self.portal.start_task_soon(consume)

    def admission_error(self) -> type[Exception] | None:
        if self.expected is S.STOPPED:
            return EngineStoppedError
        if self.expected is S.SLEEPING:
            return EngineSleepingError
        if self.expected is S.PAUSED and self.pause_mode == "abort":
            return EnginePausedError
        return None

    @rule(data=st.data())
    def abort_one(self, data: st.DataObject) -> None:
        if not self.consumers:
            return
        index = data.draw(st.integers(0, len(self.consumers) - 1))
        self.uninterrupted.discard(index)
        consumer = self.consumers[index][0]
        if consumer.chunks:
            self.portal.call(self._abort, consumer.chunks[0].request_id)

    async def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @rule()
    def inject_cache_error(self) -> None:
        tracker = self.engine._loop.tracker
        live = list(tracker.requests) if tracker else []
        if live:
            self.faults.cache_not_ready_at[self.faults.num_steps + 1] = {live[0]}
            for i, (c, *_rest) in enumerate(self.consumers):
                if (c.chunks and c.chunks[0].request_id == live[0]) or not c.chunks:
                    self.uninterrupted.discard(i)

    # -- control --------------------------------------------------------------------

    @precondition(lambda self: self.expected in (S.RUNNING, S.PAUSED))
    @rule(mode=st.sampled_from(["abort", "drain", "keep"]))
    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.uninterrupted.clear()
        self.call(self.engine.pause, mode)
        if self.expected is S.RUNNING or mode == "abort":
            self.pause_mode = mode
        self.expected = S.PAUSED

    @precondition(lambda self: self.expected in (S.RUNNING, S.PAUSED))
    @rule()
    def resume(self) -> None:
        self.call(self.engine.resume)
        self.expected, self.pause_mode = S.RUNNING, None

    @precondition(lambda self: self.expected in (S.RUNNING, S.PAUSED, S.SLEEPING))
    @rule(level=st.sampled_from([1, 2]), mode=st.sampled_from(["abort", "drain"]))
    def sleep(self, level: int, mode: str) -> None:
        if mode == "abort" and self.expected is not S.SLEEPING:
            self.uninterrupted.clear()
        if self.expected is not S.SLEEPING:
            self.resume_to = self.expected
            if self.expected is S.RUNNING:
                self.pause_mode = mode
        self.sleeping = {"weights", "kv_cache"}
        self.call(self.engine.sleep, level, mode)
        self.expected = S.SLEEPING
        for stats in self.engine.memory_stats().values():
            assert stats.kv_cache_bytes == 0 and stats.weights_bytes == 0

    @precondition(lambda self: self.expected is S.SLEEPING)
    @rule(tags=st.lists(st.sampled_from(["weights", "kv_cache"]), min_size=1, unique=True))
    def wakeup(self, tags: list[str]) -> None:
        self.call(self.engine.wakeup, tags)
        self.sleeping -= set(tags)
        if not self.sleeping:
            self.expected = self.resume_to
            if self.expected is S.RUNNING:
                self.pause_mode = None

    @precondition(lambda self: self.expected is not S.STOPPED and "weights" not in self.sleeping)
    @rule()
    def update_weights(self) -> None:
        version = self.engine.weight_version
        self.call(self.engine.update_weights, self.weights)
        assert self.engine.weight_version == version + 1

    @precondition(lambda self: self.expected is not S.STOPPED)
    @rule()
    def stop(self) -> None:
        self.portal.call(self._stop)
        self.run_future.result(timeout=BOUND)
        self.expected = S.STOPPED
        self.uninterrupted.clear()

    async def _stop(self) -> None:
        self.engine.stop()

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def state_is_the_expected_one(self) -> None:
        assert self.engine.state is self.expected, (self.engine.state, self.expected)
        assert set(self.engine.sleeping_tags) == (
            self.sleeping if self.expected is S.SLEEPING else set()
        )

    @invariant()
    def at_most_one_terminal_chunk_and_it_is_last(self) -> None:
        for consumer, *_ in self.consumers:
            reasons = [c.finish_reason for c in list(consumer.chunks)]
            finished = [i for i, r in enumerate(reasons) if r is not None]
            assert finished in ([], [len(reasons) - 1]), reasons

    @invariant()
    def idle_means_every_block_is_free(self) -> None:
        tracker = self.engine._loop.tracker
        if tracker is not None and len(tracker) == 0 and self.expected is not S.SLEEPING:
            stats = self.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks, stats

    def teardown(self) -> None:
        try:
            if self.expected is not S.STOPPED:
                if self.expected is S.SLEEPING:
                    self.call(self.engine.wakeup, ["weights", "kv_cache"])
                if self.engine.state is S.PAUSED:
                    self.call(self.engine.resume)
                self.portal.call(self._drain_then_stop)
                self.run_future.result(timeout=BOUND)
            for consumer, *_ in self.consumers:
                self.call(consumer.done.wait)  # every request ended: no hang
            self.check_uninterrupted_outputs()
            assert self.engine.state is S.STOPPED
        finally:
            self._portal_cm.__exit__(None, None, None)
        assert engine_threads() == []

    async def _drain_then_stop(self) -> None:
        with anyio.fail_after(BOUND):
            for consumer, *_ in self.consumers:
                await consumer.done.wait()
        self.engine.stop()

    def check_uninterrupted_outputs(self) -> None:
        reference = reference_tokens(str(self.model_dir), self.backend)
        for index in self.uninterrupted:
            consumer, prompt, max_tokens, _ = self.consumers[index]
            if consumer.chunks and consumer.chunks[-1].finish_reason == "length":
                assert tokens_of(consumer.chunks) == reference[(prompt, max_tokens)]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lifecycle_state_machine(backend: str, tiny_llama_dir: Path) -> None:
    machine = type(
        "Machine", (LifecycleMachine,), {"model_dir": tiny_llama_dir, "backend": backend}
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            # shrinking restarts an engine per attempt: minutes; CI reports the raw example
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            + ([] if os.environ.get("CI") else [Phase.shrink]),
        ),
    )
