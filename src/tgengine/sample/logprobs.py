"""Log probabilities of chosen tokens and of the most likely ones, for a batch of rows.

One ``log_softmax``, one ``gather`` and one ``topk`` over the whole batch, then a single
transfer to Python lists: no loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """For each row: the chosen token's log probability and the top ``k`` (ids, values)."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]

    def top(self, i: int) -> dict[int, float]:
        """Row ``i``'s top tokens, most likely first."""
        return dict(zip(self.top_ids[i], self.top_values[i], strict=True))


def token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: Sequence[int]
) -> TokenLogprobs:
    """``logprobs`` is ``[rows, vocab]`` (log-softmaxed), ``chosen`` ``[rows]`` token ids,
    ``num_top[i]`` how many alternatives row ``i`` wants (0..vocab)."""
    picked = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[1])
    if k == 0:
        return TokenLogprobs(picked, [[] for _ in num_top], [[] for _ in num_top])
    values, ids = logprobs.topk(k, dim=-1)
    all_ids, all_values = ids.tolist(), values.tolist()
    top_ids = [row[:n] for row, n in zip(all_ids, num_top, strict=True)]
    top_values = [row[:n] for row, n in zip(all_values, num_top, strict=True)]
    return TokenLogprobs(picked, top_ids, top_values)
