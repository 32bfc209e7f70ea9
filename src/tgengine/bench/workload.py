"""Seeded benchmark workloads: token-id prompts with their ``max_tokens``.

Prompts are random token ids (no tokenizer involved, so every system sees exactly the same
ids); the same ``seed`` always gives the same workload. Every request is greedy and ignores
EOS, so each one generates exactly ``max_tokens`` tokens on every system.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Token ids below this are often special tokens (BOS/EOS/chat markers) in small vocabularies.
_FIRST_ID = 16


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """``num_requests`` prompts of ``prompt_len`` tokens and ``max_tokens``, both (lo, hi)."""

    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 512)
    max_tokens: tuple[int, int] = (16, 256)
    seed: int = 0

    def scaled(self, scale: float) -> WorkloadSpec:
        """The same spread with every length multiplied by ``scale`` (at least 1)."""
        if scale == 1.0:
            return self
        return WorkloadSpec(
            self.num_requests,
            (_scale(self.prompt_len[0], scale), _scale(self.prompt_len[1], scale)),
            (_scale(self.max_tokens[0], scale), _scale(self.max_tokens[1], scale)),
            self.seed,
        )

    def describe(self) -> str:
        p, m = self.prompt_len, self.max_tokens
        return (
            f"{self.num_requests} requests, prompt {p[0]}-{p[1]} tokens, max_tokens {m[0]}-{m[1]}, "
            f"greedy, ignore_eos, seed {self.seed}"
        )


def _scale(value: int, scale: float) -> int:
    return max(1, round(value * scale))


def make_workload(spec: WorkloadSpec, vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    """The requests of ``spec``: lengths uniform in their ranges, clipped to fit the model."""
    rng = random.Random(spec.seed)
    first = _FIRST_ID if vocab_size > 4 * _FIRST_ID else 0
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        max_tokens = rng.randint(*spec.max_tokens)
        prompt_len = max(1, min(prompt_len, max_model_len - 2))
        max_tokens = max(1, min(max_tokens, max_model_len - 1 - prompt_len))
        prompt = [rng.randrange(first, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, max_tokens))
    return requests


def fixed_workload(
    num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """``num_requests`` random prompts of exactly ``prompt_len`` tokens, ``max_tokens`` each."""
    rng = random.Random(seed)
    first = _FIRST_ID if vocab_size > 4 * _FIRST_ID else 0
    return [
        BenchRequest([rng.randrange(first, vocab_size) for _ in range(prompt_len)], max_tokens)
        for _ in range(num_requests)
    ]


def summarize(requests: list[BenchRequest]) -> dict[str, int]:
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "max_prompt_len": max((len(r.prompt) for r in requests), default=0),
        "max_max_tokens": max((r.max_tokens for r in requests), default=0),
    }
