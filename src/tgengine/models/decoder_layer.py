"""``DecoderLayer``: attention then a feed-forward block, the layer every architecture stacks."""

from __future__ import annotations

import torch
from torch import nn

from tgengine.models.config import ModelConfig
from tgengine.models.gemm import LinearWeights
from tgengine.models.layers import MLP, RMSNorm
from tgengine.models.moe import SparseMoE
from tgengine.models.self_attention import Attention, StepContext
from tgengine.runtime.parallel import ParallelContext


class DecoderLayer(nn.Module):
    """Attention then a feed-forward block (dense ``MLP`` or ``SparseMoE``), each residual.

    Pre-norms only (Llama and most): ``input_layernorm`` before attention and
    ``post_attention_layernorm`` before the MLP. With ``sandwich_norms`` (Gemma 3) the
    attention and the MLP outputs are normed too before they join the residual, and the MLP's
    pre-norm is ``pre_feedforward_layernorm``.
    """

    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.parallel = parallel
        self.self_attn = Attention(config, layer, parallel)
        moe = config.moe
        ffn: MLP | SparseMoE
        if moe is not None and moe.sparse_layers[layer]:
            ffn = SparseMoE(config.hidden_size, moe, config.hidden_act, parallel)
            self._ffn_name = moe.block_name
        else:
            ffn = MLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                fused=config.fused_projections,
                parallel=parallel,
            )
            self._ffn_name = "mlp"
        self.add_module(self._ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=offset)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=offset)

    @property
    def ffn(self) -> MLP | SparseMoE:
        found = getattr(self, self._ffn_name)
        assert isinstance(found, (MLP, SparseMoE))
        return found

    def linear_weights(self) -> list[LinearWeights]:
        return [*self.self_attn.linear_weights(), *self.ffn.linear_weights()]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepContext, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is ``residual + x`` (just ``x`` for the first layer, whose
        ``residual`` is None); returns it as the same kind of pair, so that each sum is done
        by the norm after it (``RMSNorm.add_and_norm``, fused where it applies)."""
        # With tensor parallelism attention and the MLP return partial sums: one all-reduce
        # each completes them (no-ops at world size 1).
        reduce = self.parallel.all_reduce
        fused = step.fused
        h, residual = self.input_layernorm.add_and_norm(x, residual, fused=fused)
        attn = reduce(self.self_attn(h, step, layer))
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_and_norm(attn, residual, fused=fused)
            return reduce(self._ffn_forward(h, step, fused)), residual
        residual = residual + self.post_attention_layernorm(attn)
        mlp = reduce(self._ffn_forward(self.pre_feedforward_layernorm(residual), step, fused))
        return self.post_feedforward_layernorm(mlp), residual

    def _ffn_forward(self, h: torch.Tensor, step: StepContext, fused: bool) -> torch.Tensor:
        ffn = self.ffn
        if isinstance(ffn, MLP):
            return ffn(h, step.gemm, fused=fused)
        return ffn(h, step.gemm)
