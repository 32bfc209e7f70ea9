"""``EngineLoop``: schedule → execute → publish, one step at a time.

It owns what a step touches: the executor, the scheduler, the request registry (the
tracker) and the weight version. Its parent (the Engine) talks to it through the methods
below and answers it through ``LoopOwner``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc

from ..agent.agent import AgentInfo, MemoryStats
from ..config import EngineConfig
from ..core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from ..core.sequence import Sequence
from ..core.step import SeqStep, StepBatch, StepResult
from ..errors import StepTimeoutError
from ..executor import Executor
from ..executor.base import AbsorbsParts, StagesWeights
from ..outputs import FinishReason
from ..stats import Counters, EngineStats
from ..structured_outputs import bitmasks
from .request_stats import EngineObserver, StepStats, request_stats
from .requests import Request, RequestTracker


class LoopOwner(Protocol):
    """What the loop asks of the component that runs it (the Engine's state machine)."""

    def can_step(self) -> bool:
        """Whether a step may run now."""
        ...

    def loop_failed(self, cause: BaseException) -> None:
        """The loop is failing with ``cause``: end every request now, before the clean-up."""
        ...


class EngineLoop:
    """Drives the scheduler and the executor.

    It steps only while ``owner.can_step()`` allows (the Engine's state machine decides)
    and there is work. Control calls act between two steps (``between_steps``).
    ``scheduler`` and ``tracker`` exist once ``run`` started; read them, do not write.
    """

    def __init__(self, config: EngineConfig, executor: Executor, owner: LoopOwner) -> None:
        self.config = config
        self.executor = executor
        self._owner = owner
        self.last_step_time: float | None = None
        self.num_preemptions = 0
        self.scheduler: Scheduler | None = None
        self.tracker: RequestTracker | None = None
        self._info: AgentInfo | None = None
        self.weight_version = 0  # counts the weights the executor loaded after the first
        self._step_lock = anyio.Lock()
        self._work = anyio.Event()
        self._progress = anyio.Event()
        self.num_steps = 0
        self.observers: list[EngineObserver] = []  # told of finished requests and steps
        self.step_hooks: list[Callable[[StepStats], None]] = []  # after the observers (tests)

    async def prepare(self) -> None:
        """What the executor measures on a quiet process, before anything loads (threads)."""
        await anyio.to_thread.run_sync(self.executor.prepare)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the executor, then step whenever allowed; returns only when cancelled."""
        async with anyio.create_task_group() as tg:
            info = await tg.start(self.executor.run)
            self._setup(info)
            task_status.started(info)
            try:
                await self._serve()
            except Exception as exc:
                self._owner.loop_failed(exc)  # every request gets its error chunk now
                raise

    async def _serve(self) -> None:
        while True:
            await self._wait_for_work()
            async with self._step_lock:
                stalled = self._owner.can_step() and not await self._step()
            if stalled:  # work exists but none is runnable until something changes
                await self._work.wait()

    def _setup(self, info: AgentInfo) -> None:
        cfg = self.config
        self._info = info
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_prefix_caching=cfg.enable_prefix_caching,
                sliding_window=info.model_config.kv_window,
            )
        )
        eos = frozenset(info.model_config.eos_token_ids)
        self.tracker = RequestTracker(self.scheduler, eos, info.max_model_len)
        self.tracker.finish_hooks.append(lambda request: self.notify())
        self.tracker.group_hooks.append(self._request_done)

    def _request_done(self, members: list[Request]) -> None:
        stats = request_stats(members)
        for observer in self.observers:
            observer.request_finished(stats)

    # -- the registry, for the Engine ------------------------------------------------

    def admit(self, requests: list[Request], *, hold: bool) -> None:
        """Register the sequences of one request; ``hold``: keep them out of the scheduler
        until ``release_held`` (the engine does not step now)."""
        self._tracker.add(requests, hold=hold)
        if not hold:
            self.notify()

    def release_held(self) -> None:
        """Schedule every held request."""
        if self.tracker is not None:
            self.tracker.release_held()
        self.notify()

    def is_in_use(self, request_id: str) -> bool:
        """Whether an unfinished request (or sequence) has this id."""
        return self._tracker.is_in_use(request_id)

    def group(self, public_id: str) -> list[Request]:
        """The unfinished sequences of request ``public_id`` (empty if unknown)."""
        return self.tracker.group(public_id) if self.tracker is not None else []

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End ``request`` now with a final chunk, and free its blocks. Idempotent."""
        if self.tracker is not None:
            self.tracker.finish(request, reason, error=error)

    def finish_all(self, reason: FinishReason, error: str | None = None) -> None:
        """End every admitted request, held ones included."""
        for request in list(self.tracker.requests.values()) if self.tracker is not None else []:
            self.finish(request, reason, error)

    def finish_held(self, reason: FinishReason) -> None:
        """End every held request (not yet scheduled)."""
        for request in list(self.tracker.held) if self.tracker is not None else []:
            self.finish(request, reason)

    # -- control between two steps, for the Engine ------------------------------------

    @asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold the loop between two steps: a step in flight returns first."""
        async with self._step_lock:
            yield

    async def sleep(self, level: int) -> None:
        """Release the KV cache (and with level 2 the weights); every block is free after.

        Running sequences (kept ones: ``sleep(mode="keep")``) are preempted first: they
        are recomputed once the loop steps again."""
        async with self._step_lock:
            self.preempt_all()
            await self.executor.sleep(level)
            self._scheduler.reset_cache(self._scheduler.block_manager.num_blocks)

    async def wakeup(self, tag: str) -> None:
        """Make ``tag`` resident again (weights reloaded from disk count as new weights)."""
        async with self._step_lock:
            if await self.executor.wakeup(tag):
                self.weight_version += 1

    async def apply_weights(
        self,
        named: list[Any],
        *,
        stage: bool,
        recompute: bool,
        absorbed: tuple[str, ...] | list[str] = (),
    ) -> None:
        """Apply ``named`` weights between two steps, whole (shielded once begun); then
        ``weights_changed``. ``stage``: the weights sleep; the executor keeps the tensors
        for their wakeup (``StagesWeights``). ``absorbed``: names the executor packed as
        their parts came (``AbsorbsParts``), settled first (``named`` is later)."""
        async with self._step_lock:
            with anyio.CancelScope(shield=True):
                if absorbed:
                    assert isinstance(self.executor, AbsorbsParts)
                    await self.executor.settle_absorbed(list(absorbed))
                if stage:
                    assert isinstance(self.executor, StagesWeights)
                    await self.executor.stage_weights(named)
                else:
                    await self.executor.update_weights(named)
                self.weight_version += 1
                self.weights_changed(recompute=recompute)

    def memory_stats(self) -> dict[str, MemoryStats]:
        return self.executor.memory_stats()

    def stats(self, state: str) -> EngineStats:
        """A snapshot of the steps, the queues and the blocks, for an engine in ``state``
        (zeros before the loop started)."""
        scheduler, tracker = self.scheduler, self.tracker
        blocks = scheduler.block_manager if scheduler is not None else None
        counters = tracker.counters if tracker is not None else Counters()
        held = len(tracker.held) if tracker is not None else 0
        return EngineStats(
            state=state,
            num_running=scheduler.num_running if scheduler is not None else 0,
            num_waiting=(scheduler.num_waiting if scheduler is not None else 0) + held,
            num_free_blocks=blocks.num_free_blocks if blocks is not None else 0,
            num_total_blocks=blocks.num_blocks if blocks is not None else 0,
            kv_cache_usage=blocks.usage if blocks is not None else 0.0,
            weight_version=self.weight_version,
            num_steps=self.num_steps,
            last_step_time=self.last_step_time,
            prompt_tokens_total=counters.prompt_tokens,
            generation_tokens_total=counters.generation_tokens,
            num_preemptions_total=self.num_preemptions,
            finished_total=dict(counters.finished),
            prefix_cache_queries_total=blocks.num_queried_tokens if blocks is not None else 0,
            prefix_cache_hits_total=blocks.num_hit_tokens if blocks is not None else 0,
        )

    @property
    def _scheduler(self) -> Scheduler:
        assert self.scheduler is not None, "the loop has started"
        return self.scheduler

    @property
    def _tracker(self) -> RequestTracker:
        assert self.tracker is not None, "the loop has started"
        return self.tracker

    # -- stepping ---------------------------------------------------------------------

    def notify(self) -> None:
        """Wake the loop and anyone waiting for progress: the work or the gate changed."""
        self._work.set()
        self._progress.set()

    async def _wait_for_work(self) -> None:
        while not (self._owner.can_step() and self._has_work()):
            await self._work.wait()
            self._work = anyio.Event()

    def _has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished()

    async def wait_until_idle(self) -> None:
        """Return once no admitted request is left in the scheduler."""
        while self._has_work():
            await self._progress.wait()
            self._progress = anyio.Event()

    def preempt_all(self) -> int:
        """Preempt every running sequence for recompute (between two steps: hold
        ``_step_lock``); they are recomputed once the loop steps again. Returns how many."""
        preempted = self._scheduler.preempt_all()
        self.num_preemptions += len(preempted)
        return len(preempted)

    def weights_changed(self, *, recompute: bool) -> None:
        """New weights (between two steps): cached prefixes are stale; with ``recompute``
        every running sequence is preempted, to be recomputed with them."""
        if recompute:
            self.preempt_all()
        self._scheduler.block_manager.forget_prefixes()
        self.notify()

    async def _step(self) -> bool:
        """Run one step; False when nothing could be scheduled."""
        scheduler, tracker = self._scheduler, self._tracker
        batch = scheduler.schedule()
        # counted at once: a step cancelled in flight (a stop) still preempted them
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            if batch.preempted:
                return True  # blocks were freed: the next schedule can admit
            self._work = anyio.Event()
            return False
        step = self._step_batch(batch)
        await self._fill_token_bitmasks(step)
        timeout = self.config.step_timeout
        try:
            with anyio.fail_after(timeout) if timeout is not None else _no_deadline():
                result = await self.executor.execute(step)
        except TimeoutError as exc:
            raise StepTimeoutError(timeout or 0.0) from exc
        self.num_steps += 1
        self.last_step_time = anyio.current_time()
        stats = _step_stats(batch, result, tracker)  # before publish: who had no token yet
        scheduler.update_after_step(batch, result.token_ids, failed=result.errors.keys())
        for observer in self.observers:
            observer.step_finished(stats)
        for hook in self.step_hooks:
            hook(stats)
        tracker.publish(batch.seqs, result, self.weight_version)
        self.notify()
        return True

    def _step_batch(self, batch: ScheduledBatch) -> StepBatch:
        tracker = self._tracker
        seqs = []
        now = time.monotonic()
        for i, seq in enumerate(batch.seqs):
            request = tracker.get(seq.seq_id)
            if request is not None and request.scheduled_time is None:
                request.scheduled_time = now
            seqs.append(_seq_step(seq, batch.num_new_tokens[i], request, batch.needs_sample(i)))
        return StepBatch(seqs, tracker.take_finished_ids())

    async def _fill_token_bitmasks(self, step: StepBatch) -> None:
        """Give each constrained sequence that samples its mask of allowed tokens.

        Off the event loop: the matchers first replay the tokens they have not seen
        (after a preemption, nothing; a restarted matcher, all of them). A sequence whose
        tokens the grammar rejects ends with an error instead.
        """
        tracker = self._tracker
        assert self._info is not None
        jobs: list[bitmasks.BitmaskJob] = []
        rows: dict[str, SeqStep] = {}
        for seq_step in step.seqs:
            request = tracker.get(seq_step.seq_id)
            if seq_step.params is None or request is None or request.grammar is None:
                continue
            completion = request.seq.completion_token_ids
            jobs.append(bitmasks.BitmaskJob(seq_step.seq_id, request.grammar, completion))
            rows[seq_step.seq_id] = seq_step
        if not jobs:
            return
        vocab_size = self._info.model_config.vocab_size
        # looked up in its module at each step: the bench wraps it there to time it
        filled = await anyio.to_thread.run_sync(bitmasks.fill_bitmasks, jobs, vocab_size)
        for i, seq_id in enumerate(filled.seq_ids):
            rows[seq_id].token_bitmask = filled.bitmask[i]
        for seq_id, error in filled.errors.items():
            request = tracker.get(seq_id)
            if request is not None:
                tracker.finish(request, "error", error=error)


def _step_stats(batch: ScheduledBatch, result: StepResult, tracker: RequestTracker) -> StepStats:
    """The step's counts; a sequence counts its prompt with its first sampled token."""
    num_prompt = num_generated = 0
    for seq in batch.seqs:
        request = tracker.get(seq.seq_id)
        if request is None or seq.seq_id in result.errors or seq.seq_id not in result.token_ids:
            continue  # aborted meanwhile, failed, or a prompt chunk that samples nothing
        num_generated += 1
        if request.first_token_time is None:
            num_prompt += seq.num_prompt_tokens
    return StepStats(batch.num_batched_tokens, num_prompt, num_generated)


def _seq_step(seq: Sequence, n: int, request: Request | None, sample: bool) -> SeqStep:
    start = seq.num_computed_tokens
    step = SeqStep(seq.seq_id, seq.token_ids[start : start + n], start, list(seq.block_table))
    step.num_released_blocks = seq.num_released_blocks
    if request is None:
        return step
    params = request.params
    if sample:
        step.params = params
        if params.needs_token_history:
            step.history = list(seq.token_ids)
            step.num_prompt_tokens = seq.num_prompt_tokens
    if request.wants_prompt_logprobs and start + 1 < seq.num_prompt_tokens:
        step.prompt_targets = seq.token_ids[start + 1 : min(start + n + 1, seq.num_prompt_tokens)]
        step.prompt_logprobs = params.prompt_logprobs or 0
    return step


def _no_deadline() -> anyio.CancelScope:
    return anyio.CancelScope()
