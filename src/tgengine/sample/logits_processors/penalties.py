"""``Penalties``: repetition (vLLM), frequency and presence (OpenAI), in one batched pass.

``repetition_penalty`` r over the prompt and the output: a seen token's logit ``x``
becomes ``x / r`` if positive, ``x * r`` otherwise. Then, over the output only,
``x -= frequency_penalty * count + presence_penalty * (count > 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import SamplingRow, padded_tokens, token_counts


class Penalties:
    def is_active(self, row: SamplingRow) -> bool:
        return row.params.has_penalties

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        device, vocab_size = logits.device, logits.shape[1]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(r.params, name) for r in rows], device=device)[:, None]

        counts = token_counts([r.output_token_ids for r in rows], vocab_size, device)
        if any(r.params.repetition_penalty != 1 for r in rows):
            seen = counts > 0
            prompts = padded_tokens([r.prompt_token_ids for r in rows], vocab_size, device)
            in_prompt = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
            in_prompt.scatter_(1, prompts, True)
            seen |= in_prompt[:, :vocab_size]
            penalty = column("repetition_penalty").expand_as(logits)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        frequency, presence = column("frequency_penalty"), column("presence_penalty")
        return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
