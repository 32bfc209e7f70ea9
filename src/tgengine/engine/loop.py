"""``EngineLoop``: schedule → execute → publish, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.abc

from ..agent.agent import AgentInfo
from ..config import EngineConfig
from ..core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from ..core.sequence import Sequence
from ..core.step import SeqStep, StepBatch
from ..executor import Executor
from ..structured_outputs.bitmasks import BitmaskJob, fill_bitmasks
from .requests import Request, RequestTracker


class StepTimeoutError(TimeoutError):
    """A forward step did not return within ``EngineConfig.step_timeout``."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"forward step did not return within step_timeout={timeout} s")


class EngineLoop:
    """Drives the scheduler and the executor.

    It steps only while ``can_step()`` allows (the Engine's state machine decides) and
    there is work. Control calls take ``step_lock`` to act between two steps.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        can_step: Callable[[], bool],
        weight_version: Callable[[], int],
        on_fault: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.executor = executor
        self._can_step = can_step
        self._weight_version = weight_version
        self._on_fault = on_fault
        self.last_step_time: float | None = None
        self.num_preemptions = 0
        self.scheduler: Scheduler | None = None
        self.tracker: RequestTracker | None = None
        self.info: AgentInfo | None = None
        self.step_lock = anyio.Lock()
        self._work = anyio.Event()
        self._progress = anyio.Event()
        self._finished_ids: list[str] = []
        self.num_steps = 0
        self.step_hooks: list[Callable[[int], None]] = []  # called with the batched tokens

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
                self._on_fault(exc)  # every request gets its error chunk now, not after cleanup
                raise

    async def _serve(self) -> None:
        while True:
            await self._wait_for_work()
            async with self.step_lock:
                stalled = self._can_step() and not await self._step()
            if stalled:  # work exists but none is runnable until something changes
                await self._work.wait()

    def _setup(self, info: AgentInfo) -> None:
        cfg = self.config
        self.info = info
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
        self.tracker = RequestTracker(eos, info.max_model_len)
        self.tracker.finish_hooks.append(self._on_finish)

    def _on_finish(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.abort(request.request_id)  # a no-op for a request it never saw
        self._finished_ids.append(request.request_id)
        self.notify()

    def notify(self) -> None:
        """Wake the loop and anyone waiting for progress: the work or the gate changed."""
        self._work.set()
        self._progress.set()

    async def _wait_for_work(self) -> None:
        while not (self._can_step() and self._has_work()):
            await self._work.wait()
            self._work = anyio.Event()

    def _has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished()

    async def wait_until_idle(self) -> None:
        """Return once no admitted request is left in the scheduler."""
        while self._has_work():
            await self._progress.wait()
            self._progress = anyio.Event()

    async def _step(self) -> bool:
        """Run one step; False when nothing could be scheduled."""
        assert self.scheduler is not None and self.tracker is not None
        batch = self.scheduler.schedule()
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
        self.scheduler.update_after_step(batch, failed=result.errors.keys())
        for hook in self.step_hooks:
            hook(batch.num_batched_tokens)
        self.tracker.publish(batch.seqs, result, self._weight_version())
        self.notify()
        return True

    def _step_batch(self, batch: ScheduledBatch) -> StepBatch:
        assert self.tracker is not None
        seqs = []
        now = time.monotonic()
        for i, seq in enumerate(batch.seqs):
            request = self.tracker.get(seq.seq_id)
            if request is not None and request.scheduled_time is None:
                request.scheduled_time = now
            seqs.append(_seq_step(seq, batch.num_new_tokens[i], request, batch.needs_sample(i)))
        finished, self._finished_ids = self._finished_ids, []
        return StepBatch(seqs, finished)

    async def _fill_token_bitmasks(self, step: StepBatch) -> None:
        """Give each constrained sequence that samples its mask of allowed tokens.

        Off the event loop: the matchers first replay the tokens they have not seen
        (after a preemption, nothing; a restarted matcher, all of them). A sequence whose
        tokens the grammar rejects ends with an error instead.
        """
        assert self.tracker is not None and self.info is not None
        jobs: list[BitmaskJob] = []
        rows: dict[str, SeqStep] = {}
        for seq_step in step.seqs:
            request = self.tracker.get(seq_step.seq_id)
            if seq_step.params is None or request is None or request.grammar is None:
                continue
            completion = request.seq.completion_token_ids
            jobs.append(BitmaskJob(seq_step.seq_id, request.grammar, completion))
            rows[seq_step.seq_id] = seq_step
        if not jobs:
            return
        vocab_size = self.info.model_config.vocab_size
        filled = await anyio.to_thread.run_sync(fill_bitmasks, jobs, vocab_size)
        for i, seq_id in enumerate(filled.seq_ids):
            rows[seq_id].token_bitmask = filled.bitmask[i]
        for seq_id, error in filled.errors.items():
            request = self.tracker.get(seq_id)
            if request is not None:
                self.tracker.finish(
                    request, "error", error=error, weight_version=self._weight_version()
                )


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
