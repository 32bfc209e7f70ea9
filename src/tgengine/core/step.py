"""What one engine step asks of the model and what it gets back. Plain data: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams


@dataclass
class SeqStep:
    """One sequence's part of a step: compute ``token_ids`` at ``start_pos`` onward.

    ``params`` is set when a token is sampled after this step (the last prompt chunk
    or a decode); ``None`` for a prompt chunk that is not the last. ``history`` (every
    token so far, the first ``num_prompt_tokens`` being the prompt) is sent only when
    sampling reads it (``params.needs_token_history``). ``prompt_targets`` is set when the
    request wants prompt log probabilities (``prompt_logprobs`` alternatives each): the
    prompt tokens that this chunk's positions predict, in order. ``token_bitmask`` (int32
    words, bit ``t`` set when token ``t`` is allowed) is set when the sequence's output is
    constrained (structured outputs). ``block_table`` starts at the sequence's block number
    ``num_released_blocks``: the blocks before it fell out of every layer's sliding window.
    """

    seq_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    params: SamplingParams | None = None
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    prompt_targets: list[int] | None = None
    prompt_logprobs: int = 0
    token_bitmask: Any = None  # numpy int32 row, or None when unconstrained
    num_released_blocks: int = 0


@dataclass
class StepBatch:
    seqs: list[SeqStep]
    finished_ids: list[str] = field(default_factory=list)  # per-request state to drop


@dataclass(frozen=True)
class TokenInfo:
    """A chosen token's log probability and the top alternatives ``{token id: logprob}``."""

    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class PromptLogprobs:
    """Log probabilities of prompt tokens ``start .. start + len(tokens) - 1``."""

    start: int
    tokens: list[TokenInfo]


@dataclass
class StepResult:
    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenInfo] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # seq_id -> CacheNotReadyError text
