"""Turn one forward step's logits into the step's result: sampled tokens, log probabilities.

The logits rows come in ``prepare_inputs``' order: per sequence, the positions whose
prompt log probabilities are wanted, then its sampling position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..core.step import PromptLogprobs, SeqStep, StepResult, TokenInfo
from .logits_processors import SamplingRow
from .logprobs import token_logprobs
from .sampler import Sampler


def sample_step(
    logits: torch.Tensor,
    seqs: list[SeqStep],
    sampler: Sampler,
    generator: Callable[[SeqStep], torch.Generator | None],
    result: StepResult,
) -> None:
    """Sample every sequence that has ``params``; fill ``result`` in place."""
    sample_rows: list[int] = []
    sampling: list[SeqStep] = []
    row = 0
    for seq in seqs:
        if seq.prompt_targets:
            num = len(seq.prompt_targets)
            result.prompt_logprobs[seq.seq_id] = _prompt_logprobs(logits[row : row + num], seq)
            row += num
        if seq.params is not None:
            sample_rows.append(row)
            sampling.append(seq)
            row += 1
    if not sampling:
        return
    if row != len(sample_rows):  # some rows were prompt positions
        logits = logits[torch.tensor(sample_rows, device=logits.device)]
    rows = [_row(seq, generator(seq)) for seq in sampling]
    sampled = sampler(logits, rows)
    for i, seq in enumerate(sampling):
        result.token_ids[seq.seq_id] = sampled.token_ids[i]
        lp = sampled.logprobs
        if lp is not None and seq.params is not None and seq.params.logprobs is not None:
            result.logprobs[seq.seq_id] = TokenInfo(lp.chosen[i], lp.top(i))


def _row(seq: SeqStep, generator: torch.Generator | None) -> SamplingRow:
    assert seq.params is not None
    row = SamplingRow(seq.params, generator, seq.seq_id, token_bitmask=seq.token_bitmask)
    if seq.history is None:
        return row
    prompt = seq.history[: seq.num_prompt_tokens]
    output = seq.history[seq.num_prompt_tokens :]
    return replace(row, prompt_token_ids=prompt, output_token_ids=output)


def _prompt_logprobs(logits: torch.Tensor, seq: SeqStep) -> PromptLogprobs:
    assert seq.prompt_targets is not None
    targets = torch.tensor(seq.prompt_targets, device=logits.device)
    num_top = [seq.prompt_logprobs] * len(seq.prompt_targets)
    lp = token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, num_top)
    tokens = [TokenInfo(lp.chosen[i], lp.top(i)) for i in range(len(num_top))]
    return PromptLogprobs(start=seq.start_pos + 1, tokens=tokens)
