from __future__ import annotations

import pytest

from tgengine.core import block_manager as block_manager_module
from tgengine.core.block_manager import BlockManager, hash_block
from tgengine.core.sequence import Sequence


def make_seq(seq_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, token_ids=list(token_ids))


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    """What the scheduler does once a sequence's tokens are all computed."""
    manager.mark_computed(seq, seq.num_uncomputed_tokens)
    assert seq.num_computed_tokens == seq.num_tokens


def test_allocate_counts_blocks_and_deallocate_frees_them() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(9)))
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(seq.block_table) == 3
    assert seq.num_computed_tokens == 0
    assert manager.num_free_blocks == 5
    assert manager.num_used_blocks == 3
    assert manager.usage == pytest.approx(3 / 8)
    assert all(manager.ref_count(b) == 1 for b in seq.block_table)
    manager.check_invariants()

    manager.deallocate(seq)
    assert seq.block_table == []
    assert seq.block_hashes == []
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_can_allocate_refuses_when_too_few_blocks() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", list(range(9)))
    assert not manager.can_allocate(seq)
    with pytest.raises(RuntimeError):
        manager.allocate(seq)
    assert seq.block_table == []
    manager.check_invariants()


def test_freed_blocks_are_reused_last_and_tail_first() -> None:
    manager = BlockManager(num_blocks=6, block_size=1, enable_prefix_caching=False)
    a = make_seq("a", [1, 2, 3])
    manager.allocate(a)
    assert a.block_table == [0, 1, 2]
    manager.deallocate(a)
    b = make_seq("b", [1, 2, 3, 4, 5, 6])
    manager.allocate(b)
    # Never-used blocks first, then a's blocks tail first.
    assert b.block_table == [3, 4, 5, 2, 1, 0]


def test_hit_only_after_mark_computed() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    a = make_seq("a", prompt)
    manager.allocate(a)
    b = make_seq("b", prompt)
    manager.allocate(b)
    assert b.num_computed_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)

    compute_all(manager, a)
    assert len(a.block_hashes) == 2
    c = make_seq("c", prompt)
    manager.allocate(c)
    assert c.block_table[:2] == a.block_table[:2]
    assert c.block_table[2] != a.block_table[2]
    assert c.num_computed_tokens == c.num_cached_tokens == 8
    assert c.block_hashes == a.block_hashes
    manager.check_invariants()


def test_two_seqs_share_a_two_block_prefix() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    prefix = list(range(100, 108))
    a = make_seq("a", [*prefix, 1, 2, 3])
    manager.allocate(a)
    compute_all(manager, a)
    free_before = manager.num_free_blocks

    b = make_seq("b", [*prefix, 7, 8, 9, 10, 11])
    assert manager.can_allocate(b)
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert [manager.ref_count(x) for x in b.block_table[:2]] == [2, 2]
    assert manager.num_free_blocks == free_before - 2  # only its own 2 new blocks

    manager.deallocate(a)
    assert [manager.ref_count(x) for x in b.block_table[:2]] == [1, 1]
    manager.deallocate(b)
    assert manager.num_free_blocks == 10
    manager.check_invariants()


def test_hit_never_covers_the_last_token() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    a = make_seq("a", prompt)
    manager.allocate(a)
    compute_all(manager, a)
    b = make_seq("b", prompt)
    manager.allocate(b)
    assert b.num_computed_tokens == 4
    assert b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]

    one = make_seq("one", prompt[:4])
    manager.allocate(one)
    assert one.num_computed_tokens == 0


def test_freed_block_keeps_its_prefix_and_a_hit_takes_it_back() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    manager.allocate(a)
    compute_all(manager, a)
    cached = a.block_table[:2]
    manager.deallocate(a)
    assert manager.num_free_blocks == 4

    b = make_seq("b", [1, 2, 3, 4, 9])
    manager.allocate(b)
    assert b.block_table[:2] == cached
    assert b.num_computed_tokens == 4
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_can_allocate_counts_hits_on_free_blocks() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    manager.allocate(a)
    compute_all(manager, a)
    manager.deallocate(a)
    # Hits on free blocks still take free blocks: 3 blocks in all, 3 free.
    assert manager.can_allocate(make_seq("b", [1, 2, 3, 4, 5, 6]))
    assert not manager.can_allocate(make_seq("c", [1, 2, 3, 4, 5, 6, 7]))


def test_reusing_a_block_drops_its_old_prefix() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    a = make_seq("a", [1, 2, 3])
    manager.allocate(a)
    compute_all(manager, a)
    manager.deallocate(a)
    filler = make_seq("filler", [7, 7, 7, 7])
    manager.allocate(filler)  # takes both blocks, the cached one included
    manager.deallocate(filler)
    b = make_seq("b", [1, 2, 3])
    manager.allocate(b)
    assert b.num_computed_tokens == 0
    manager.check_invariants()


def test_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_manager_module, "hash_block", lambda parent, tokens: 42)
    manager = BlockManager(num_blocks=8, block_size=2)
    a = make_seq("a", [1, 2, 3])
    manager.allocate(a)
    compute_all(manager, a)
    b = make_seq("b", [5, 6, 3])  # same (fake) hash, other tokens
    manager.allocate(b)
    assert b.num_computed_tokens == 0
    assert b.block_table[0] != a.block_table[0]
    compute_all(manager, b)  # registering a colliding hash keeps the first block
    manager.check_invariants()
    c = make_seq("c", [1, 2, 9])
    manager.allocate(c)
    assert c.block_table[0] == a.block_table[0]


def test_hash_is_deterministic_and_chained() -> None:
    assert hash_block(None, (1, 2)) == hash_block(None, (1, 2))
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1))
    parent = hash_block(None, (1, 2))
    assert hash_block(parent, (3, 4)) != hash_block(None, (3, 4))


def test_prefix_caching_off_never_hits() -> None:
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq("a", [1, 2, 3, 4, 5])
    manager.allocate(a)
    compute_all(manager, a)
    assert a.block_hashes == []
    b = make_seq("b", [1, 2, 3, 4, 5])
    manager.allocate(b)
    assert b.num_computed_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)


def test_append_slot_adds_a_block_when_the_last_is_full() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    seq = make_seq("a", [1, 2])
    manager.allocate(seq)
    assert manager.can_append(seq)
    manager.append_slot(seq)
    assert len(seq.block_table) == 1
    seq.append_token(3)
    manager.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.append_token(4)
    seq.append_token(5)
    manager.append_slot(seq)
    assert len(seq.block_table) == 3
    seq.append_token(6)
    seq.append_token(7)
    assert not manager.can_append(seq)
    with pytest.raises(RuntimeError):
        manager.append_slot(seq)


def test_double_free_raises() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq("a", [1, 2, 3])
    manager.allocate(seq)
    table = list(seq.block_table)
    manager.deallocate(seq)
    seq.block_table.extend(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        manager.deallocate(seq)


def test_allocate_twice_raises() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq("a", [1, 2, 3])
    manager.allocate(seq)
    with pytest.raises(RuntimeError):
        manager.allocate(seq)


def test_reset_forgets_prefixes_and_resizes() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3])
    manager.allocate(a)
    compute_all(manager, a)
    with pytest.raises(RuntimeError, match="held"):
        manager.reset()
    manager.deallocate(a)
    manager.reset(num_blocks=6)
    assert manager.num_blocks == manager.num_free_blocks == 6
    b = make_seq("b", [1, 2, 3])
    manager.allocate(b)
    assert b.num_computed_tokens == 0
    manager.check_invariants()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4), (True, 4)])
def test_constructor_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_blocks_behind_the_window_go_back_to_the_pool() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(13)))
    manager.allocate(seq)
    held = list(seq.block_table)
    compute_all(manager, seq)
    # The next query is at 13 and reads keys 8..13 (window 6): blocks 0 and 1 are dead.
    manager.release_out_of_window(seq, window=6)
    assert seq.num_released_blocks == 2
    assert seq.block_table == held[2:]
    assert manager.num_used_blocks == 2
    assert [manager.ref_count(b) for b in held] == [0, 0, 1, 1]
    manager.check_invariants()
    manager.release_out_of_window(seq, window=6)  # nothing more is dead
    assert seq.num_released_blocks == 2 and manager.num_used_blocks == 2
    # The next token's block is counted after the released ones.
    for token in (13, 14, 15, 16):
        seq.append_token(token)
    assert manager.can_append(seq)
    manager.append_slot(seq)
    assert len(seq.block_table) == 3
    manager.deallocate(seq)
    assert seq.num_released_blocks == 0 and seq.block_table == []
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_a_released_block_is_a_prefix_hit_until_it_is_reused() -> None:
    manager = BlockManager(num_blocks=5, block_size=4)
    a = make_seq("a", list(range(13)))
    manager.allocate(a)
    released = a.block_table[:2]
    compute_all(manager, a)
    manager.release_out_of_window(a, window=6)
    # Its KV is still there and depends on the prefix only: a prompt sharing it hits.
    b = make_seq("b", [*range(8), 99])
    manager.allocate(b)
    assert b.block_table[:2] == released and b.num_cached_tokens == 8
    manager.deallocate(b)
    # Once the pool hands the blocks out for other content, nobody hits them any more.
    c = make_seq("c", [50 + t for t in range(12)])
    manager.allocate(c)
    assert set(released) <= set(c.block_table)
    manager.deallocate(c)
    d = make_seq("d", [*range(8), 98])
    manager.allocate(d)
    assert d.num_cached_tokens == 0
    manager.check_invariants()
