"""``EngineStats``: a snapshot of the engine for tests, /metrics and dashboards."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    state: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    weight_version: int
    num_steps: int
    last_step_time: float | None
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    finished_total: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found there
    num_restarts_total: int = 0  # engines started again after a death (EngineSupervisor)


@dataclass
class Counters:
    """Running totals, kept by the request tracker."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)
