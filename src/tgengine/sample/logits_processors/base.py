"""What a logits processor sees, and how the sampler applies a list of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...sampling import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One sequence that samples this step.

    ``generator`` is the request's own generator, present iff ``params.seed`` is set; the
    caller creates it once per request (``manual_seed(seed)``) and keeps it across steps.
    It may live on the CPU or on the logits' device. ``prompt_token_ids`` and
    ``output_token_ids`` are filled when ``params.needs_token_history`` (penalties,
    ``min_tokens``); ``seq_id`` names the sequence for processors that keep state.
    ``token_bitmask`` is the row's mask of allowed tokens when its output is constrained
    (structured outputs).
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    seq_id: str = ""
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    token_bitmask: Any = None


class LogitsProcessor(Protocol):
    """One batched step over the logits, applied only to the rows it is active for."""

    def is_active(self, row: SamplingRow) -> bool:
        """Whether ``row`` needs this processor (False at the parameter's neutral value)."""

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The processed logits of ``rows`` (``[len(rows), vocab]``); may modify in place."""


def apply_processors(
    logits: torch.Tensor, rows: Sequence[SamplingRow], processors: Sequence[LogitsProcessor]
) -> torch.Tensor:
    """Run each processor, in order, over the rows it is active for."""
    for processor in processors:
        active = [i for i, row in enumerate(rows) if processor.is_active(row)]
        if not active:
            continue
        if len(active) == len(rows):
            logits = processor.apply(logits, rows)
            continue
        index = torch.tensor(active, device=logits.device)
        logits[index] = processor.apply(logits[index], [rows[i] for i in active])
    return logits


def padded_tokens(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[rows, longest]`` token ids, padded with ``vocab_size`` (one past the vocabulary)."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = [list(tokens) + [vocab_size] * (width - len(tokens)) for tokens in token_lists]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(padded), width)


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[rows, vocab]`` occurrences of each token in each row's list (one scatter-add)."""
    tokens = padded_tokens(token_lists, vocab_size, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    return counts[:, :vocab_size]
