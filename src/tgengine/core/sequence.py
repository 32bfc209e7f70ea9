"""``Sequence``: one request's tokens and KV bookkeeping. Plain Python: no torch, no anyio."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    NEW = "new"  # not given to a scheduler yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The token ids of one request and where their KV lives.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache (prefix
    cache hits included). The model computes ``token_ids[num_computed_tokens:]`` in one
    or more steps (chunked prefill); a token is sampled once all of them are computed.
    ``block_table`` holds the blocks the sequence still owns, from its block number
    ``num_released_blocks`` on: the leading blocks before it fell out of every layer's
    sliding window and went back to the pool (zero unless every layer is local).
    ``block_hashes[i]`` is the prefix hash of the sequence's full block number ``i``
    (released ones included), known once that block is full and computed.

    ``leader`` is the first sequence of the same prompt (``n > 1``): this one is admitted
    only once the leader's prompt is computed, so that it reuses the leader's cached
    blocks instead of computing the prompt again. ``reuse_cached_prefix=False`` computes
    every prompt position (their log probabilities are wanted).

    One writer per field, all in ``core/``: the scheduler writes ``token_ids`` (the sampled
    tokens), ``status`` and ``num_preemptions``; its block manager writes the KV fields
    (``num_computed_tokens``, ``num_cached_tokens``, ``block_table``, ``block_hashes``,
    ``num_released_blocks``). Everyone else reads.
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.NEW
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_released_blocks: int = 0
    num_preemptions: int = 0
    leader: Sequence | None = None
    reuse_cached_prefix: bool = True

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def waits_for_leader(self) -> bool:
        """Whether the leader is still computing the shared prompt."""
        leader = self.leader
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < min(leader.num_prompt_tokens, self.num_prompt_tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
