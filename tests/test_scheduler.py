from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tgengine.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tgengine.core.sequence import Sequence, SequenceStatus


def fake_next_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context."""
    return (sum(token_ids[-3:]) * 7 + len(token_ids)) % 11


def reference_completion(prompt: list[int], max_new: int) -> list[int]:
    token_ids = list(prompt)
    for _ in range(max_new):
        token_ids.append(fake_next_token(token_ids))
    return token_ids[len(prompt) :]


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    enable_prefix_caching: bool = True,
    sliding_window: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        enable_prefix_caching,
        sliding_window,
    )
    return Scheduler(config)


def make_seq(seq_id: str, num_tokens: int, first: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, token_ids=list(range(first, first + num_tokens)))


def step(scheduler: Scheduler, max_new: dict[str, int] | None = None) -> ScheduledBatch:
    """One engine step with the fake model; finishes sequences that reach ``max_new``."""
    batch = scheduler.schedule()
    sampled = {
        seq.seq_id: fake_next_token(seq.token_ids)
        for i, seq in enumerate(batch.seqs)
        if batch.needs_sample(i) and not seq.is_finished
    }
    scheduler.update_after_step(batch, sampled)
    for seq in batch.seqs:
        if seq.seq_id in sampled:
            assert seq.token_ids[-1] == sampled[seq.seq_id]
            if max_new is not None and seq.num_completion_tokens >= max_new[seq.seq_id]:
                scheduler.finish(seq)
    return batch


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(4, 4, 0, 16)


def test_fcfs_admission_and_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"s{i}", 5, first=10 * i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    batch = step(scheduler)
    assert batch.seqs == seqs[:2]
    assert batch.num_new_tokens == [5, 5]
    assert scheduler.num_running == 2
    assert scheduler.num_waiting == 2
    assert list(scheduler.waiting) == seqs[2:]
    scheduler.finish(seqs[0])
    batch = scheduler.schedule()
    assert batch.seqs == [seqs[1], seqs[2]]
    assert batch.num_new_tokens == [1, 5]


def test_strict_fcfs_head_blocks_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    scheduler.add(make_seq("small", 4))
    scheduler.add(make_seq("big", 16))
    scheduler.add(make_seq("tiny", 1))
    batch = scheduler.schedule()
    assert [s.seq_id for s in batch.seqs] == ["small"]
    assert [s.seq_id for s in scheduler.waiting] == ["big", "tiny"]


def test_chunked_prefill_of_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq("long", 100)
    scheduler.add(seq)
    chunks = []
    while True:
        batch = step(scheduler)
        chunks.append(batch.num_new_tokens[0])
        if batch.needs_sample(0):
            break
    assert chunks == [16] * 6 + [4]
    assert seq.num_completion_tokens == 1
    assert step(scheduler).num_new_tokens == [1]  # then it decodes


def test_budget_is_shared_and_running_go_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b = make_seq("a", 6), make_seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    batch = step(scheduler)
    assert batch.num_new_tokens == [6, 4]
    assert batch.do_sample == [True, False]
    batch = step(scheduler)
    assert batch.seqs == [a, b]
    assert batch.num_new_tokens == [1, 4]
    assert batch.num_batched_tokens == 5


def test_decode_every_step() -> None:
    scheduler = make_scheduler()
    seqs = [make_seq("a", 3), make_seq("b", 7)]
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler)
    for _ in range(10):
        batch = step(scheduler)
        assert batch.seqs == seqs
        assert batch.num_new_tokens == [1, 1]
        assert all(batch.needs_sample(i) for i in range(2))
    assert [s.num_completion_tokens for s in seqs] == [11, 11]


def test_preemption_then_recompute_yields_the_same_tokens() -> None:
    # 4 blocks of 2 tokens: two 3-token prompts fit, but not while both decode.
    max_new = {"a": 5, "b": 5}
    scheduler = make_scheduler(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3])
    b = Sequence("b", [4, 5, 6])
    scheduler.add(a)
    scheduler.add(b)
    preempted: list[Sequence] = []
    for _ in range(50):
        if not scheduler.has_unfinished():
            break
        preempted += step(scheduler, max_new).preempted
    assert not scheduler.has_unfinished()
    assert preempted and all(s is b for s in preempted)
    assert b.num_preemptions == len(preempted)
    assert a.num_preemptions == 0
    assert a.completion_token_ids == reference_completion([1, 2, 3], 5)
    assert b.completion_token_ids == reference_completion([4, 5, 6], 5)
    assert scheduler.num_free_blocks == 4


def test_preempted_sequences_return_to_the_front_in_arrival_order() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=1, max_num_batched_tokens=64)
    seqs = [Sequence(f"s{i}", [i]) for i in range(3)]
    late = Sequence("late", [9])
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler)  # all three prefill and sample: each now needs a second block
    scheduler.add(late)
    batch = step(scheduler)
    assert batch.seqs == [seqs[0]]
    assert batch.preempted == [seqs[2], seqs[1]]
    assert list(scheduler.waiting) == [seqs[1], seqs[2], late]


def test_prefix_hit_at_admission_skips_computed_blocks() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_seq("a", 10)
    scheduler.add(a)
    step(scheduler)
    b = make_seq("b", 10)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b]
    assert batch.num_new_tokens == [1, 2]
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]


def test_a_follower_comes_back_with_its_leader_when_the_prompt_is_cached() -> None:
    """``n > 1``: a follower waits for its leader to compute the prompt. Once both were
    preempted (``pause("keep")``), the leader's re-admission finds its prompt cached, so
    the follower comes back in the same step, reusing those blocks."""
    scheduler = make_scheduler(block_size=4)
    leader = make_seq("r#0", 8)
    follower = Sequence(seq_id="r#1", token_ids=list(range(8)), leader=leader)
    scheduler.add(leader)
    scheduler.add(follower)
    assert step(scheduler).seqs == [leader]  # the follower waits for the prompt
    assert step(scheduler).seqs == [leader, follower]
    step(scheduler)
    assert scheduler.preempt_all() == [follower, leader]
    batch = scheduler.schedule()
    assert batch.seqs == [leader, follower]
    assert leader.num_cached_tokens >= leader.num_prompt_tokens
    assert follower.block_table[:2] == leader.block_table[:2]


def test_a_failed_step_computes_nothing_and_caches_no_prefix() -> None:
    scheduler = make_scheduler(num_blocks=8)
    a = make_seq("a", 9)
    scheduler.add(a)
    batch = scheduler.schedule()
    scheduler.update_after_step(batch, failed={"a"})
    assert a.num_computed_tokens == 0 and a.block_hashes == []
    scheduler.finish(a)
    b = make_seq("b", 9)  # the same tokens: nothing to hit
    scheduler.add(b)
    scheduler.schedule()
    assert b.num_cached_tokens == 0


def test_abort_frees_blocks_and_is_idempotent() -> None:
    scheduler = make_scheduler(num_blocks=8)
    a, b = make_seq("a", 9), make_seq("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert scheduler.num_free_blocks == 3
    scheduler.finish(a)
    assert a.is_finished and a.block_table == []
    assert scheduler.num_free_blocks == 6
    scheduler.update_after_step(batch, {"a": 7, "b": 7})  # a finished while the step ran: skipped
    assert a.num_computed_tokens == 0 and a.num_tokens == 9
    assert b.num_computed_tokens == 5 and b.token_ids[-1] == 7
    scheduler.finish(a)  # idempotent
    assert scheduler.num_free_blocks == 6
    scheduler.block_manager.check_invariants()
    assert scheduler.abort_all() == [b]
    assert scheduler.num_free_blocks == 8
    assert not scheduler.has_unfinished()


def test_abort_a_waiting_sequence() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq("a", 3))
    b = make_seq("b", 3)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(b)
    assert b.status is SequenceStatus.FINISHED
    assert scheduler.num_waiting == 0


def test_finish_rejects_a_sequence_never_added() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="not in this scheduler"):
        scheduler.finish(make_seq("a", 3))


def test_add_rejects_a_sequence_twice_and_empty_prompts() -> None:
    """A duplicate id is the request tracker's to refuse (the one registry of ids); the
    scheduler refuses a sequence it was given already, queued, running or finished."""
    scheduler = make_scheduler()
    a = make_seq("a", 3)
    scheduler.add(a)
    with pytest.raises(ValueError):
        scheduler.add(a)
    step(scheduler)
    assert a.status is SequenceStatus.RUNNING
    with pytest.raises(ValueError):
        scheduler.add(a)
    scheduler.finish(a)
    with pytest.raises(ValueError):
        scheduler.add(a)
    with pytest.raises(ValueError):
        scheduler.add(Sequence("empty", []))


def test_reset_cache_needs_no_running_sequences() -> None:
    scheduler = make_scheduler(num_blocks=8)
    seq = make_seq("a", 3)
    scheduler.add(seq)
    step(scheduler)
    with pytest.raises(RuntimeError, match="running"):
        scheduler.reset_cache()
    scheduler.finish(seq)
    scheduler.reset_cache(num_blocks=16)
    assert scheduler.num_total_blocks == scheduler.num_free_blocks == 16
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.max_tokens_capacity == 64


BASE_PROMPT = list(range(20, 36))


class SchedulerMachine(RuleBasedStateMachine):
    """Drives a Scheduler with a fake model whose KV cache is simulated slot by slot."""

    @initialize(
        num_blocks=st.integers(2, 10),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 24),
        enable_prefix_caching=st.booleans(),
        sliding_window=st.one_of(st.none(), st.integers(1, 9)),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool,
        sliding_window: int | None,
    ) -> None:
        self.scheduler = make_scheduler(
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            enable_prefix_caching,
            sliding_window,
        )
        self.block_size = block_size
        self.window = sliding_window
        # (block, offset) -> the context whose KV that slot holds.
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.max_new: dict[str, int] = {}
        self.live: dict[str, Sequence] = {}
        self.num_added = 0

    @precondition(lambda self: len(self.live) < 6)
    @rule(data=st.data(), num_seqs=st.integers(1, 3))
    def add(self, data: st.DataObject, num_seqs: int) -> None:
        for _ in range(num_seqs):
            self._add(data)

    def _add(self, data: st.DataObject) -> None:
        capacity = self.scheduler.max_tokens_capacity
        # Short prompts (a shared prefix and a few tokens) let several sequences run at once.
        max_prompt = max(1, capacity // 3)
        num_shared = data.draw(st.integers(0, min(len(BASE_PROMPT), max_prompt)))
        suffix = data.draw(st.lists(st.integers(0, 3), max_size=max_prompt - num_shared))
        prompt = BASE_PROMPT[:num_shared] + suffix or [0]
        # Long generations are what fill the cache and force preemption.
        room = capacity - len(prompt)
        max_new = room - data.draw(st.integers(0, room - 1))
        seq = Sequence(f"r{self.num_added}", prompt)
        self.num_added += 1
        self.max_new[seq.seq_id] = max_new
        self.live[seq.seq_id] = seq
        self.scheduler.add(seq)

    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._step()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort_during_step(self, data: st.DataObject) -> None:
        batch = self.scheduler.schedule()
        self._compute(batch)
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self._abort(seq_id)
        self._finish_step(batch)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._abort(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(data=st.data())
    def finish_early(self, data: st.DataObject) -> None:
        """The engine finishes a sequence on a stop token."""
        seq = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler.finish(seq)
        self.scheduler.finish(seq)  # idempotent
        del self.live[seq.seq_id]

    @precondition(lambda self: not self.scheduler.running)
    @rule()
    def reset_cache(self) -> None:
        self.scheduler.reset_cache()
        self.kv.clear()

    @precondition(lambda self: len(self.live) >= 3)
    @rule()
    def drain(self) -> None:
        self._drain()

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self._drain()
        assert self.scheduler.num_free_blocks == self.scheduler.num_total_blocks
        self.scheduler.block_manager.check_invariants()

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        scheduler = self.scheduler
        manager = scheduler.block_manager
        manager.check_invariants()
        assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
        refs = Counter(b for seq in scheduler.running for b in seq.block_table)
        for block in range(manager.num_blocks):
            assert manager.ref_count(block) == refs[block]
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        for seq in scheduler.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens < seq.num_tokens
            num_blocks = seq.num_released_blocks + len(seq.block_table)
            assert num_blocks * self.block_size >= seq.num_computed_tokens
            # Only blocks that no later query of the sequence reads are released.
            first_read = self._first_read(seq, seq.num_computed_tokens)
            assert seq.num_released_blocks * self.block_size <= first_read
        for seq in scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert seq.num_released_blocks == 0
        assert {s.seq_id for s in [*scheduler.running, *scheduler.waiting]} == set(self.live)
        if not self.live:
            assert manager.num_free_blocks == manager.num_blocks

    def _drain(self) -> None:
        # The oldest running sequence progresses every step, so this bound is never reached.
        bound = sum(s.num_prompt_tokens + self.max_new[s.seq_id] for s in self.live.values())
        for _ in range(bound + 1):
            if not self.scheduler.has_unfinished():
                break
            self._step()
        assert not self.scheduler.has_unfinished(), "livelock: requests never finished"
        assert not self.live

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if self.live:
            assert not batch.is_empty
        self._compute(batch)
        self._finish_step(batch)

    def _compute(self, batch: ScheduledBatch) -> None:
        """The fake forward pass: check the KV it reads, write the KV of the new tokens."""
        size = self.block_size
        manager = self.scheduler.block_manager
        assert batch.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            assert 1 <= num_new <= seq.num_tokens - start
            first = seq.num_released_blocks
            assert (first + len(seq.block_table)) * size >= start + num_new
            for pos in range(self._first_read(seq, start), start):
                slot = (seq.block_table[pos // size - first], pos % size)
                assert self.kv.get(slot) == tuple(seq.token_ids[: pos + 1])
            for pos in range(start, start + num_new):
                block = seq.block_table[pos // size - first]
                assert manager.ref_count(block) == 1  # never write a shared block
                self.kv[(block, pos % size)] = tuple(seq.token_ids[: pos + 1])

    def _first_read(self, seq: Sequence, position: int) -> int:
        """The first key position that a query at ``position`` or later attends to."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def _finish_step(self, batch: ScheduledBatch) -> None:
        sampled = {
            seq.seq_id: fake_next_token(seq.token_ids)
            for i, seq in enumerate(batch.seqs)
            if not seq.is_finished and batch.needs_sample(i)
        }
        self.scheduler.update_after_step(batch, sampled)
        for seq in batch.seqs:
            if seq.seq_id not in sampled:
                continue
            # every token computed before the sampled one, which the scheduler appended
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert seq.token_ids[-1] == sampled[seq.seq_id]
            max_new = self.max_new[seq.seq_id]
            if seq.num_completion_tokens >= max_new:
                prompt = seq.token_ids[: seq.num_prompt_tokens]
                assert seq.completion_token_ids == reference_completion(prompt, max_new)
                self.scheduler.finish(seq)
                del self.live[seq.seq_id]

    def _abort(self, seq_id: str) -> None:
        seq = self.live[seq_id]
        self.scheduler.finish(seq)
        assert seq.is_finished and seq.block_table == []
        self.scheduler.finish(seq)  # idempotent
        assert seq not in self.scheduler.running and seq not in self.scheduler.waiting
        del self.live[seq_id]


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


@pytest.mark.parametrize(("window", "max_held"), [(6, 3), (None, 16)])
def test_a_long_decode_holds_only_the_window(window: int | None, max_held: int) -> None:
    """Every layer local: blocks behind the window go back; otherwise every block is kept."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, sliding_window=window)
    seq = make_seq("a", 5)
    scheduler.add(seq)
    peak = 0
    while seq.num_tokens < 64:
        batch = scheduler.schedule()
        peak = max(peak, scheduler.block_manager.num_used_blocks)
        scheduler.update_after_step(batch, {"a": fake_next_token(seq.token_ids)})
        scheduler.block_manager.check_invariants()
    # ceil(window / block_size) blocks, plus one when the window straddles a block boundary.
    assert peak == max_held
    assert seq.num_released_blocks == (0 if window is None else 14)
