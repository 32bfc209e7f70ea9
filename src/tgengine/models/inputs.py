"""``ForwardInputs``: one step's flattened batch, as the model forward consumes it.

The ModelAgent builds it from a scheduled batch; the model only reads it. Every tensor
lives on the model's device. Tokens of all sequences are concatenated ("rows").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt or a prompt chunk).

    Its query rows are ``[start, end)``; after this step its KV holds ``context_len``
    tokens (prefix-cache hits and earlier chunks included), stored in ``block_table``.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each row
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset: where its KV goes
    decode_rows: torch.Tensor  # [Bd] int64, rows that are single-token queries
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [Bd] int64, KV length after this step
    prefills: list[PrefillSpan] = field(default_factory=list)
    logits_rows: torch.Tensor | None = None  # [S] int64, rows whose logits are returned

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])
