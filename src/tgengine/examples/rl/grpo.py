"""The trainer side of the loop: a transformers model, a torch optimizer, a GRPO step.

Samples come from the engine with the log probability it gave each token; the trainer
computes its own for the same tokens (a forward pass over prompt + completion), so the two
can be compared before each step: they are the same weights, pushed by the last step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class Sample:
    """One sampled completion, as the engine streamed it, and what the loop made of it."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, of token_ids
    weight_versions: set[int] = field(default_factory=set)  # of every chunk with tokens
    finish_reason: str | None = None
    reward: float = 0.0
    advantage: float = 0.0


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """GRPO's advantages of one group: ``(r - mean) / (std + eps)``; all 0 when equal."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True)
class StepStats:
    """What one ``Trainer.train_step`` measured.

    ``logprob_abs_diff_mean`` / ``_max``: |trainer - engine| log probability over every
    sampled token, computed before the step (same weights on both sides). ``kl`` estimates
    KL(before || after) on the sampled tokens from the second pass when
    ``epochs > 1``, else None.
    """

    step: int
    loss: float
    num_tokens: int
    logprob_abs_diff_mean: float
    logprob_abs_diff_max: float
    trainer_logprob_mean: float
    kl: float | None
    grad_norm: float


class Trainer:
    """A causal LM from ``model_dir`` in float32 and AdamW over its last ``train_layers``.

    ``train_layers=None`` trains every parameter; otherwise the decoder layers before the
    last ``train_layers`` (and the embeddings, tied to the output head in SmolLM2) are
    frozen: the backward pass and the weight push shrink to what changes.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        lr: float = 2e-5,
        train_layers: int | None = None,
        epochs: int = 1,
        clip: float = 0.2,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        num_layers = int(self.model.config.num_hidden_layers)
        first = 0 if train_layers is None else max(0, num_layers - train_layers)
        self._trained: list[tuple[str, torch.nn.Parameter]] = []
        for name, param in self.model.named_parameters():
            layer = _LAYER.search(name)
            if train_layers is None or (layer is not None and int(layer.group(1)) >= first):
                self._trained.append((name, param))
            elif name.endswith("model.norm.weight"):
                self._trained.append((name, param))
            else:
                param.requires_grad_(False)
        params = [p for _, p in self._trained]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        self.epochs = epochs
        self.clip = clip
        self.step = 0

    def trained_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors the steps change, under the checkpoint's names (what to push)."""
        return [(name, param.detach()) for name, param in self._trained]

    def token_logprobs(self, group: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log probabilities of each sample's tokens, ``[n, T]``, and their mask."""
        prompt = group[0].prompt_ids
        longest = max(len(s.token_ids) for s in group)
        pad = int(self.model.config.pad_token_id or 0)
        ids = torch.full((len(group), len(prompt) + longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(group):
            n = len(prompt) + len(s.token_ids)
            ids[i, :n] = torch.tensor(prompt + s.token_ids)
            mask[i, :n] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        logits = logits[:, len(prompt) - 1 : len(prompt) - 1 + longest].float()
        targets = ids[:, len(prompt) :]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, mask[:, len(prompt) :].bool()

    def train_step(self, groups: Sequence[Sequence[Sample]]) -> StepStats:
        """``epochs`` clipped policy-gradient passes over ``groups``; ``step`` increments.

        The loss is the token mean of ``-min(ratio * A, clip(ratio) * A)`` with the ratio
        against the first pass (1 in it, so one epoch is plain REINFORCE with GRPO's
        advantages). Groups whose samples all got the same reward carry no gradient.
        """
        groups = [g for g in groups if any(len(s.token_ids) for s in g)]
        num_tokens = sum(len(s.token_ids) for g in groups for s in g)
        old: list[torch.Tensor] = []
        diffs: list[torch.Tensor] = []
        trainer_logp: list[torch.Tensor] = []
        kl_sum, loss_sum, grad_norm = 0.0, 0.0, 0.0
        for epoch in range(self.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for g, group in enumerate(groups):
                logp, mask = self.token_logprobs(group)
                adv = torch.tensor([s.advantage for s in group]).unsqueeze(-1)
                if epoch == 0:
                    old.append(logp.detach())
                    engine = torch.zeros_like(logp)
                    for i, s in enumerate(group):
                        engine[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
                    diffs.append((logp.detach() - engine).abs()[mask])
                    trainer_logp.append(logp.detach()[mask])
                elif epoch == 1:
                    delta = (logp.detach() - old[g])[mask]
                    kl_sum += float((torch.exp(delta) - 1 - delta).sum())  # k3, >= 0
                ratio = torch.exp(logp - old[g])
                clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
                objective = torch.minimum(ratio * adv, clipped * adv)
                loss = -(objective * mask).sum() / max(1, num_tokens)
                loss.backward()
                loss_sum += float(loss.detach()) if epoch == 0 else 0.0
            params = [p for _, p in self._trained]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        all_diffs = torch.cat(diffs) if diffs else torch.zeros(1)
        all_logp = torch.cat(trainer_logp) if trainer_logp else torch.zeros(1)
        return StepStats(
            step=self.step,
            loss=loss_sum,
            num_tokens=num_tokens,
            logprob_abs_diff_mean=float(all_diffs.mean()),
            logprob_abs_diff_max=float(all_diffs.max()),
            trainer_logprob_mean=float(all_logp.mean()),
            kl=kl_sum / max(1, num_tokens) if self.epochs > 1 else None,
            grad_norm=grad_norm,
        )
