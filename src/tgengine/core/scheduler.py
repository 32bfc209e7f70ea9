"""``Scheduler``: continuous batching under a token budget, chunked prefill, preemption.

Plain Python: no torch, no anyio. One step is ``schedule()`` → the model computes the batch →
``update_after_step(batch, sampled)`` (the computed tokens counted, the sampled ones appended)
→ the engine ends the requests that are done with ``finish``. The scheduler holds queues, not
a registry: which ids are admitted is the request tracker's to know.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes the scheduler works within; validated on construction."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    # Every layer attends to at most this many latest keys: blocks behind it are released.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window)


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``seqs[i]``.

    Sequence ``i`` computes ``token_ids[c : c + num_new_tokens[i]]`` where ``c`` is its
    ``num_computed_tokens`` before ``update_after_step``. ``do_sample[i]`` (read it through
    ``needs_sample(i)``) is fixed at scheduling time: after this step all its tokens are
    computed, so one token is sampled from the last position. ``preempted`` lists the
    sequences this schedule sent back to the waiting queue (for stats only).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    do_sample: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def needs_sample(self, i: int) -> bool:
        return self.do_sample[i]

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.do_sample.append(seq.num_computed_tokens + num_new_tokens >= seq.num_tokens)


class Scheduler:
    """FCFS admission, running sequences first, recompute preemption of the newest.

    ``waiting`` is a FCFS deque (preempted sequences go back to its front, in arrival order);
    ``running`` is in admission order. A request never fails for lack of KV cache: when a
    decoding sequence needs a block and none is free, the most recently admitted sequence
    not yet scheduled in this step is preempted (its blocks are freed and it is recomputed
    later, mostly from the prefix cache). The oldest running sequence is therefore never
    preempted and always progresses, which rules out livelock as long as every request fits
    in ``max_tokens_capacity`` (the engine checks that on admission).
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def max_tokens_capacity(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``, a new sequence, at the back of ``waiting``."""
        if not seq.token_ids:
            raise ValueError(f"token_ids: sequence {seq.seq_id!r} has no tokens")
        if seq.status is not SequenceStatus.NEW or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} was added already or holds blocks")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts within ``max_num_batched_tokens``."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        # After a preemption the cache is tight: admitting now would only preempt again.
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def update_after_step(
        self,
        batch: ScheduledBatch,
        sampled: Mapping[str, int] | None = None,
        failed: Collection[str] = (),
    ) -> None:
        """Count the batch's tokens as computed; register newly full blocks for prefix hits;
        append each sequence's ``sampled`` token (``{seq_id: token}``).

        With ``sliding_window`` set, blocks that fell out of the window are then released.

        Sequences finished (aborted) while the step ran are skipped, and so are the ``failed``
        ones (ids whose step did not compute their KV): their blocks must never be hit.
        """
        sampled = sampled or {}
        for seq, num_new_tokens in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in failed:
                continue
            self.block_manager.mark_computed(seq, num_new_tokens)
            if self.config.sliding_window is not None:
                self.block_manager.release_out_of_window(seq, self.config.sliding_window)
            token = sampled.get(seq.seq_id)
            if token is not None:
                seq.append_token(token)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` from its queue and free its blocks. Idempotent.

        Raises ``ValueError`` for a sequence that was never added.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.NEW:
            raise ValueError(f"sequence {seq.seq_id!r} is not in this scheduler")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def abort_all(self) -> list[Sequence]:
        """Finish every running and waiting sequence; return them."""
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self.finish(seq)
        return seqs

    def preempt_all(self) -> list[Sequence]:
        """Preempt every running sequence for recompute, newest first; return them.

        Their blocks are freed (their full blocks stay cached as prefixes until reused or
        forgotten) and they go back to the front of ``waiting`` in admission order, ahead of
        the sequences that were waiting: they keep their tokens and are recomputed first.
        """
        preempted: list[Sequence] = []
        while self.running:
            seq = self.running.pop()
            self._preempt(seq)
            preempted.append(seq)
        return preempted

    def reset_cache(self, num_blocks: int | None = None) -> None:
        """Forget all blocks and cached prefixes (the KV cache was reallocated).

        Waiting sequences hold no blocks and stay queued; running ones must be gone.
        """
        if self.running:
            raise RuntimeError(
                f"cannot reset the KV cache: {len(self.running)} sequences are running"
            )
        self.block_manager.reset(num_blocks)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_new_tokens == 0:
                i += 1
                continue
            if not self._reserve_slots(seq, batch):
                break  # seq preempted itself: it was the last running sequence
            batch.add(seq, num_new_tokens)
            budget -= num_new_tokens
            i += 1
        return budget

    def _reserve_slots(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Find blocks for ``seq``, preempting from the tail; False if ``seq`` was preempted.

        Sequences before ``seq`` in ``running`` are scheduled already, so the tail is always
        the newest unscheduled one.
        """
        while not self.block_manager.can_append(seq):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.append_slot(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        # Victims come newest first, so each goes in front of the previous: arrival order.
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for_leader or not self.block_manager.can_allocate(seq):
                break  # strict FCFS: nobody overtakes the head
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new_tokens = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, num_new_tokens)
            budget -= num_new_tokens


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
