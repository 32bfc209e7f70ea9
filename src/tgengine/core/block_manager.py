"""``BlockManager``: ref-counted KV cache blocks with prefix caching. Plain Python: no torch."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Prefix hash of one full block: a 128-bit blake2b of its parent's hash and its tokens.

    Deterministic across processes and runs (no ``PYTHONHASHSEED``), so the whole prefix up to
    and including this block is named by one integer.
    """
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass
class Block:
    """One physical KV block. ``block_hash`` is set only while the block is in the hash table."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and shares computed prefixes between them.

    Free blocks are kept in release order and taken from the oldest end, so a block freed
    recently (whose cached prefix may be wanted again) is reused last. A full block's hash is
    registered only once its KV is computed (``mark_computed``); a freed block keeps its
    registration until it is reused for other content, so later requests can still hit it.
    A hit compares the cached tokens too, so a hash collision is a miss, never wrong KV.
    ``num_queried_tokens`` and ``num_hit_tokens`` count, over every allocation, the tokens
    looked up in the prefix cache and those found there (vLLM's prefix cache metrics).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        _check_positive("num_blocks", num_blocks)
        _check_positive("block_size", block_size)
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._init_blocks(num_blocks)

    def _init_blocks(self, num_blocks: int) -> None:
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # An ordered set: O(1) removal of a free block that a prefix hit takes back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would find enough free blocks now."""
        _, num_needed = self._plan(seq)
        return num_needed <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached blocks for its leading prefix.

        Sets ``num_computed_tokens`` (and ``num_cached_tokens``) to the tokens covered by hits.
        A hit never covers the last token, so at least one token is computed and sampled from.
        """
        if seq.block_table or seq.num_released_blocks:
            raise RuntimeError(f"sequence {seq.seq_id!r} already holds blocks")
        hits, num_needed = self._plan(seq)
        if num_needed > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id!r} needs {num_needed} free blocks")
        for block_id, block_hash in hits:
            self._take_cached(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
        for _ in range(self._num_missing_blocks(seq)):
            seq.block_table.append(self._take_free())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self._block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``append_slot(seq)`` would find enough free blocks now."""
        return self._num_missing_blocks(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Give ``seq`` the blocks its uncomputed tokens need (one at most when decoding)."""
        num_missing = self._num_missing_blocks(seq)
        if num_missing > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id!r} needs {num_missing} free blocks")
        for _ in range(num_missing):
            seq.block_table.append(self._take_free())

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """Count ``num_new_tokens`` more tokens of ``seq`` as computed; register every block
        that is now full and computed in the prefix cache."""
        seq.num_computed_tokens += num_new_tokens
        if not self.enable_prefix_caching:
            return
        size = self._block_size
        first = seq.num_released_blocks
        num_full = min(seq.num_computed_tokens // size, first + len(seq.block_table))
        # Released blocks were registered before they went (``release_out_of_window``).
        for i in range(max(len(seq.block_hashes), first), num_full):
            parent_hash = seq.block_hashes[i - 1] if i else None
            token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
            block_hash = hash_block(parent_hash, token_ids)
            seq.block_hashes.append(block_hash)
            # Another sequence may have computed the same content first: keep its block.
            if block_hash not in self._hash_to_block:
                block = self.blocks[seq.block_table[i - first]]
                block.block_hash, block.parent_hash = block_hash, parent_hash
                block.token_ids = token_ids
                self._hash_to_block[block_hash] = block.block_id

    def release_out_of_window(self, seq: Sequence, window: int) -> None:
        """Give back the leading blocks of ``seq`` that no later query of it attends to.

        With every layer attending to the last ``window`` keys only, the query at position
        ``q`` reads keys ``q - window + 1 .. q``. The next query of ``seq`` is at
        ``num_computed_tokens``, so a block whose keys all sit at or before
        ``num_computed_tokens - window`` is dead for ``seq``. Its prefix registration (made by
        ``mark_computed``, which must run first) stays until the block is reused, so a later
        prompt with the same prefix can still hit it: its KV depends on that prefix only.
        """
        _check_positive("window", window)
        num_dead = max(0, seq.num_computed_tokens - window + 1) // self._block_size
        num_release = min(num_dead - seq.num_released_blocks, len(seq.block_table))
        if num_release <= 0:
            return
        for block_id in seq.block_table[:num_release]:
            self._release(block_id)
        del seq.block_table[:num_release]
        seq.num_released_blocks += num_release

    def deallocate(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``, tail first so that its tail is reused first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_released_blocks = 0
        seq.num_computed_tokens = 0

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget every block and cached prefix (the KV cache was dropped and reallocated).

        Raises ``RuntimeError`` if a sequence still holds a block.
        """
        num_held = self.num_used_blocks
        if num_held:
            raise RuntimeError(f"cannot reset the block manager: {num_held} blocks are held")
        if num_blocks is not None:
            _check_positive("num_blocks", num_blocks)
        self._init_blocks(self.num_blocks if num_blocks is None else num_blocks)

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (the weights changed, so cached KV is stale).

        Blocks held by sequences stay theirs; only the hash table is cleared.
        """
        for block in self.blocks:
            block.block_hash = block.parent_hash = None
            block.token_ids = ()
        self._hash_to_block.clear()

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the free list, ref counts or hash table disagree."""
        problems: list[str] = []
        for block in self.blocks:
            is_free = block.block_id in self._free
            if block.ref_count < 0 or is_free != (block.ref_count == 0):
                problems.append(f"block {block.block_id}: ref {block.ref_count}, free {is_free}")
            if block.block_hash is not None:
                if self._hash_to_block.get(block.block_hash) != block.block_id:
                    problems.append(f"block {block.block_id}: hash not registered to it")
        for block_hash, block_id in self._hash_to_block.items():
            if self.blocks[block_id].block_hash != block_hash:
                problems.append(f"hash table points to block {block_id} with another hash")
        if len(self._free) + sum(b.ref_count > 0 for b in self.blocks) != self.num_blocks:
            problems.append("free + used != total")
        if problems:
            raise RuntimeError("block manager invariants broken: " + "; ".join(problems))

    def _plan(self, seq: Sequence) -> tuple[list[tuple[int, int]], int]:
        """Prefix hits as ``(block_id, hash)`` pairs, and the free blocks allocation takes."""
        hits = self._find_hits(seq)
        num_free_hits = sum(self.blocks[block_id].ref_count == 0 for block_id, _ in hits)
        num_needed = _cdiv(seq.num_tokens, self._block_size) - len(hits) + num_free_hits
        return hits, num_needed

    def _find_hits(self, seq: Sequence) -> list[tuple[int, int]]:
        hits: list[tuple[int, int]] = []
        if not self.enable_prefix_caching or not seq.reuse_cached_prefix:
            return hits
        size = self._block_size
        parent_hash: int | None = None
        # Only blocks that end before the last token: that token must be computed.
        for i in range((seq.num_tokens - 1) // size):
            token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
            block_hash = hash_block(parent_hash, token_ids)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != token_ids or block.parent_hash != parent_hash:
                break
            hits.append((block_id, block_hash))
            parent_hash = block_hash
        return hits

    def _num_missing_blocks(self, seq: Sequence) -> int:
        num_held = seq.num_released_blocks + len(seq.block_table)
        return max(0, _cdiv(seq.num_tokens, self._block_size) - num_held)

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Reused for other content: its old prefix can no longer be hit.
            del self._hash_to_block[block.block_hash]
            block.block_hash = block.parent_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def _take_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
