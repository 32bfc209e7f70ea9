"""Lay a step's sequences out as one flat ``ForwardInputs`` batch."""

from __future__ import annotations

import torch

from ..core.step import SeqStep
from ..models import ForwardInputs, PrefillSpan


def prepare_inputs(seqs: list[SeqStep], block_size: int, device: torch.device) -> ForwardInputs:
    """Concatenate every sequence's new tokens; single-token queries go to the decode path.

    Logits are computed, in sequence order, for each position that predicts a prompt token
    whose log probability is wanted (``seq.prompt_targets``), then for the last position of
    each sequence that samples; ``logits_rows`` is None where that is every row in order (a
    decode step: the forward then selects none). Released blocks (out of every layer's
    window) are read as block 0, like the padding: the window masks them out.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSpan] = []
    logits_rows: list[int] = []
    for seq in seqs:
        start = len(input_ids)
        n = len(seq.token_ids)
        table = [0] * seq.num_released_blocks + seq.block_table
        input_ids.extend(seq.token_ids)
        for pos in range(seq.start_pos, seq.start_pos + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        context_len = seq.start_pos + n
        num_blocks = -(-context_len // block_size)
        if n == 1:
            decode_rows.append(start)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(context_len)
        else:
            block_table = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
            prefills.append(PrefillSpan(start, start + n, context_len, block_table))
        if seq.prompt_targets:
            logits_rows.extend(range(start, start + len(seq.prompt_targets)))
        if seq.params is not None:
            logits_rows.append(start + n - 1)
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardInputs(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        decode_rows=as_tensor(decode_rows),
        decode_block_tables=as_tensor(padded).reshape(len(padded), width),
        decode_context_lens=as_tensor(decode_lens),
        prefills=prefills,
        logits_rows=None if _every_row(logits_rows, len(input_ids)) else as_tensor(logits_rows),
    )


def _every_row(rows: list[int], num_rows: int) -> bool:
    """Whether ``rows`` is 0 .. num_rows - 1 in order (no list is built for a prefill's
    thousands of rows: their counts differ first)."""
    return len(rows) == num_rows and rows == list(range(num_rows))
