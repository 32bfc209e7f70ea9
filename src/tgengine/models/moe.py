"""``SparseMoE``: a mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE).

A router picks ``top_k`` experts per row (softmax over its logits in float32, the largest
``top_k`` kept, renormalised where the model does); the rows are then grouped by expert and
each expert that got any runs once over all of its rows, so the Python loop is over experts,
never over tokens. Experts are ``MLP``s whose weights are ordinary ``LinearWeights`` (packed
like any other linear product; one copy each), under the checkpoint's own names.
"""

from __future__ import annotations

import torch
from torch import nn

from tgengine.models.config import MoEConfig
from tgengine.models.gemm import Gemm, LinearWeights
from tgengine.models.layers import MLP
from tgengine.runtime.parallel import ParallelContext


class SparseMoE(nn.Module):
    """The router is whole on every rank; each expert holds the rank's share of its rows, so
    the output is a partial sum over ranks (one all-reduce for all experts, by the caller)."""

    def __init__(
        self, hidden_size: int, moe: MoEConfig, act: str, parallel: ParallelContext | None = None
    ) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.normalize_top_k = moe.normalize_top_k
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe.intermediate_size, act, names=moe.expert_names, parallel=parallel)
            for _ in range(moe.num_experts)
        )
        self.router = LinearWeights([self.gate])

    def linear_weights(self) -> list[LinearWeights]:
        found = [self.router]
        for expert in self.experts:
            assert isinstance(expert, MLP)
            found += expert.linear_weights()
        return found

    def route(self, x: torch.Tensor, gemm: Gemm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, both ``[rows, top_k]``: each row's experts and their shares."""
        probs = torch.softmax(gemm.linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        weights, experts = self.route(x, gemm)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        rows = order // self.top_k
        shares = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            index = rows[start : start + count]
            found = expert(x.index_select(0, index), gemm) * shares[start : start + count, None]
            out.index_add_(0, index, found)
            start += count
        return out
