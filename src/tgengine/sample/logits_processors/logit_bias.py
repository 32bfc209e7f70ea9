"""``LogitBias``: add each row's ``logit_bias`` values to the logits of their token ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import SamplingRow


class LogitBias:
    def is_active(self, row: SamplingRow) -> bool:
        return bool(row.params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        row_index: list[int] = []
        token_index: list[int] = []
        values: list[float] = []
        for i, row in enumerate(rows):
            bias = row.params.logit_bias or {}
            row_index += [i] * len(bias)
            token_index += bias.keys()
            values += bias.values()
        device = logits.device
        index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
        # The engine checked the ids against the vocabulary on admission.
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)
        return logits
