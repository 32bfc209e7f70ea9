"""``GrammarMask``: the batched logits processor of structured outputs.

Each constrained row carries its token bitmask (``SamplingRow.token_bitmask``: 32 tokens
per int32 word, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed), filled
by the engine loop from the row's grammar matcher. The processor unpacks the bitmasks of
all constrained rows at once and sets every disallowed logit to ``-inf``: one vectorised
pass, no Python loop over rows or the vocabulary. It runs before every other processor, so
biases and penalties only ever move tokens the grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch


class _Row(Protocol):
    @property
    def token_bitmask(self) -> npt.NDArray[np.int32] | None: ...


class GrammarMask:
    def is_active(self, row: Any) -> bool:
        return getattr(row, "token_bitmask", None) is not None

    def apply(self, logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
        masks = [row.token_bitmask for row in rows]
        assert all(m is not None for m in masks), "GrammarMask applies to constrained rows"
        bitmask = np.stack(masks)  # type: ignore[arg-type]
        return apply_token_bitmask_(logits, bitmask)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: npt.NDArray[np.int32]) -> torch.Tensor:
    """Set ``logits[i, t]`` to ``-inf`` where bit ``t`` of ``bitmask[i]`` is clear; in place."""
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu":
        allowed = allowed_tokens_numpy(bitmask, vocab_size)
    else:
        allowed = allowed_tokens_torch(bitmask, vocab_size, logits.device)
    return logits.masked_fill_(~allowed, float("-inf"))


def allowed_tokens_numpy(bitmask: npt.NDArray[np.int32], vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bools on the CPU; numpy's unpackbits is a C loop over bytes,
    several times faster than shifting in torch there."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def allowed_tokens_torch(
    bitmask: npt.NDArray[np.int32], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[rows, vocab_size]`` bools unpacked on ``device`` (one small upload, then shifts)."""
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=words.dtype, device=device)
    unpacked = (words.unsqueeze(-1) >> shifts) & 1
    return unpacked.reshape(len(bitmask), -1)[:, :vocab_size].bool()
