"""``Sampler``: picks one token per sequence from a batch of logits.

First the logits processors (``logits_processors``: the grammar mask, min_tokens, logit_bias,
penalties) run
over the rows that use them. Greedy rows then take the argmax. Sampled rows are scaled by
their temperature, masked by top-k and top-p, and drawn with the exponential race:
``argmax(x - log q)`` where ``x`` are the scaled logits and ``q ~ Exp(1)``, which picks
token ``i`` with probability ``softmax(x)_i`` (the Gumbel-max trick). Every step of that
is exact elementwise arithmetic or a per-row reduction, so a row's token depends only on
its own logits, its parameters and its noise: a seeded request draws its noise from its
own generator and gets the same tokens whatever else is in the batch, and wherever it sits
in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import kernels
from .logits_processors import LogitsProcessor, SamplingRow, apply_processors, default_processors
from .logprobs import TokenLogprobs, token_logprobs

__all__ = ["SampleResult", "Sampler", "SamplingRow"]


@dataclass(frozen=True)
class SampleResult:
    """The tokens picked for each row, in row order.

    ``logprobs`` is ``None`` unless some row asked for them (``params.logprobs`` is not
    None); then it holds, for every row, the log probability of its token and its
    ``params.logprobs`` most likely alternatives under the model's raw distribution
    (before the processors, temperature, top-k and top-p).
    """

    token_ids: list[int]
    logprobs: TokenLogprobs | None


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``; on a CPU through the compiled kernel (torch's reduction
    reads ~2 GB/s, 2 ms a step for 24 rows of a 49k vocabulary)."""
    found = kernels.argmax_rows(logits)
    return logits.argmax(dim=-1) if found is None else found


class Sampler:
    """Samples a batch of logits; unseeded rows share one generator seeded once."""

    def __init__(self, seed: int = 0, processors: Sequence[LogitsProcessor] | None = None) -> None:
        self.seed = seed
        self.processors = default_processors() if processors is None else list(processors)
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Pick one token for each row of ``logits`` (``[len(rows), vocab]``, float32)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        logits = logits.float()  # a no-op for float32; noise in half precision would be coarse
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_processors(logits, rows, self.processors)
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sampled:
            token_ids = _argmax(logits)
        elif len(sampled) == len(rows):
            token_ids = self._sample(logits, list(rows))
        else:
            token_ids = _argmax(logits)
            index = torch.tensor(sampled, device=logits.device)
            token_ids[index] = self._sample(logits[index], [rows[i] for i in sampled])
        logprobs = None
        if raw_logprobs is not None:
            num_top = [row.params.logprobs or 0 for row in rows]
            logprobs = token_logprobs(raw_logprobs, token_ids, num_top)
        return SampleResult(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temperatures = torch.tensor([row.params.temperature for row in rows], device=device)
        # Subtracting the row max first keeps the max at exactly 0 however small the
        # temperature, so the scaled logits never hold inf - inf.
        tiny = torch.finfo(torch.float32).tiny
        scaled = logits - logits.max(dim=-1, keepdim=True).values
        scaled = scaled / temperatures.clamp_min(tiny).unsqueeze(1)
        if any(row.params.top_k > 0 or row.params.top_p < 1 for row in rows):
            scaled = _mask_top_k_top_p(scaled, rows)
        return (scaled - self._log_noise(scaled, rows)).argmax(dim=-1)

    def _log_noise(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """``log q`` with ``q ~ Exp(1)`` per token; seeded rows draw from their own generator."""
        noise = torch.empty_like(logits)
        if any(row.generator is None for row in rows):
            _log_exponential_(noise, self._generator(logits.device))
        for i, row in enumerate(rows):
            if row.generator is not None:
                # Drawn and logged in a tensor of its own, so that not even the rounding of
                # log depends on where the row sits in the batch.
                own = torch.empty(logits.shape[1], device=row.generator.device)
                noise[i] = _log_exponential_(own, row.generator).to(logits.device)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def _log_exponential_(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``out`` with ``log q``, ``q ~ Exp(1)``, drawn as ``q = -log u``.

    Uniform draws are several times cheaper than ``exponential_`` on the CPU. ``u = 0``
    gives ``log q = inf``, so that token's score is ``-inf``: never picked, never NaN.
    """
    return out.uniform_(generator=generator).log_().neg_().log_()


def _mask_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, then outside its nucleus.

    Top-k keeps every token whose logit ties the k-th largest, so the mask depends on the
    values alone, not on how a sort breaks ties. Top-p applies to the distribution left
    after top-k and always keeps the most likely token. Rows with ``top_k=0`` and
    ``top_p=1`` come back unchanged.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    k = [min(row.params.top_k, vocab_size) or vocab_size for row in rows]
    top_k = torch.tensor(k, device=device).unsqueeze(1)
    if all(row.params.top_p >= 1 for row in rows):
        # Top-k only: a partial top-k is far cheaper than sorting the whole vocabulary.
        num_kept = max(kk for kk, row in zip(k, rows, strict=True) if row.params.top_k > 0)
        values = logits.topk(num_kept, dim=-1).values
        kth = values.gather(1, (top_k - 1).clamp_max(num_kept - 1))
        kth = kth.masked_fill(top_k == vocab_size, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([row.params.top_p for row in rows], device=device).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    kth = sorted_logits.gather(1, top_k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Mass strictly above each token; top_p == 1 must mask nothing, whatever the rounding.
    mass_above = torch.cumsum(probs, dim=-1) - probs
    outside = (mass_above >= top_p) & (top_p < 1)
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
