"""``RequestStats``: what one finished request cost, for observers such as ``/metrics``.

Times are ``time.monotonic()`` seconds; vLLM's per-request histograms are differences of
them (queue: arrival → first scheduled; prefill: scheduled → first token; decode: first →
last token; inference: scheduled → last token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .requests import Request


@dataclass(frozen=True)
class RequestStats:
    arrival_time: float
    scheduled_time: float | None  # None: never scheduled (aborted while waiting)
    first_token_time: float | None
    last_token_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int  # over all n sequences
    max_num_generation_tokens: int  # of the longest sequence
    n: int
    max_tokens: int


@dataclass(frozen=True)
class StepStats:
    """What one engine step computed and produced.

    ``num_batched_tokens``: the tokens the forward pass computed (prompt chunks and decode
    inputs). ``num_prompt_tokens``: the whole prompts of the sequences whose first token
    this step sampled; ``num_generation_tokens``: the tokens it sampled. Their sum is
    vLLM's ``iteration_tokens_total`` (prompt + generated tokens of the outputs of one
    iteration), so a request of prompt P and max_tokens M adds up to P + M over its steps.
    """

    num_batched_tokens: int
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def num_iteration_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generation_tokens


class EngineObserver(Protocol):
    """Told about every finished request and every step (on the event loop: be quick)."""

    def request_finished(self, stats: RequestStats) -> None: ...

    def step_finished(self, stats: StepStats) -> None: ...


def request_stats(members: list[Request]) -> RequestStats:
    """The stats of one request from its sequences (``n`` of them)."""
    first = members[0]

    def earliest(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    last_tokens = [m.last_token_time for m in members if m.last_token_time is not None]
    generated = [m.seq.num_completion_tokens for m in members]
    return RequestStats(
        arrival_time=first.arrival_time,
        scheduled_time=earliest([m.scheduled_time for m in members]),
        first_token_time=earliest([m.first_token_time for m in members]),
        last_token_time=max(last_tokens) if last_tokens else None,
        num_prompt_tokens=first.seq.num_prompt_tokens,
        num_generation_tokens=sum(generated),
        max_num_generation_tokens=max(generated),
        n=len(members),
        max_tokens=first.params.max_tokens,
    )
