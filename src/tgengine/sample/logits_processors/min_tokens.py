"""``MinTokens``: EOS and the stop token ids are impossible until ``min_tokens`` are out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import SamplingRow


class MinTokens:
    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def is_active(self, row: SamplingRow) -> bool:
        return len(row.output_token_ids) < row.params.min_tokens

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            stops = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                stops |= self.eos_token_ids
            stops = {t for t in stops if t < vocab_size}
            row_index += [i] * len(stops)
            token_index += sorted(stops)
        if row_index:
            device = logits.device
            rows_t = torch.tensor(row_index, device=device)
            tokens_t = torch.tensor(token_index, device=device)
            logits.index_put_((rows_t, tokens_t), torch.tensor(float("-inf"), device=device))
        return logits
