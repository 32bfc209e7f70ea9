"""Batched logits processors: each one rewrites the logits of the rows that use it.

They run in the sampler, in the fixed order of ``default_processors`` (as vLLM V1 does:
masks first, then biases, then penalties; temperature, top-k and top-p come last, in the
sampler itself). Each is vectorised over the rows it applies to: no Python loop over the
vocabulary. A processor at its neutral value is skipped, so greedy decoding with default
parameters sees exactly the model's logits.
"""

from __future__ import annotations

from ...structured_outputs.grammar_mask import GrammarMask
from .base import LogitsProcessor, SamplingRow, apply_processors
from .logit_bias import LogitBias
from .min_tokens import MinTokens
from .penalties import Penalties

__all__ = [
    "LogitBias",
    "LogitsProcessor",
    "MinTokens",
    "Penalties",
    "SamplingRow",
    "apply_processors",
    "default_processors",
]


def default_processors(eos_token_ids: frozenset[int] = frozenset()) -> list[LogitsProcessor]:
    """The processors in the order they apply.

    The grammar mask (structured outputs) goes first, so that biases and penalties only
    ever move tokens the grammar allows.
    """
    return [GrammarMask(), MinTokens(eos_token_ids), LogitBias(), Penalties()]
