"""``Attention``: one decoder layer's self-attention over the paged KV cache, every variant.

Projections (q/k/v as one GEMM over fused row blocks, or the checkpoint's own fused
``qkv_proj``), optional per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE with the layer's own
frequencies, the layer's sliding window and the model's attention scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tgengine.kernels import elementwise
from tgengine.models.attention import AttentionPlan, paged_attention, write_kv
from tgengine.models.config import ModelConfig
from tgengine.models.fused import fused_rows
from tgengine.models.gemm import Gemm, LinearWeights
from tgengine.models.inputs import ForwardInputs
from tgengine.models.kv_cache import KVCache
from tgengine.models.layers import RMSNorm
from tgengine.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    local_heads,
    local_kv_heads,
)
from tgengine.models.rope import apply_rotary
from tgengine.runtime.parallel import ParallelContext


@dataclass
class StepContext:
    """What every layer reads during one forward, besides its hidden states.

    ``plans`` holds one attention plan per distinct window (None: full attention) and
    ``rotary`` one ``(cos, sin)`` per RoPE (0: the model's, 1: the local layers' own).
    """

    inputs: ForwardInputs
    plans: dict[int | None, AttentionPlan]
    kv_cache: KVCache
    rotary: list[tuple[torch.Tensor, torch.Tensor]]
    gemm: Gemm
    fused: bool = False
    """Run the element-wise work in compiled kernels where they apply (``kernels.elementwise``)."""
    decode_layers: bool = False
    """A decode step whose qualifying layers run as one call each (``models.fused_decode``)."""


class Attention(nn.Module):
    """This rank's heads (all of them at world size 1); the output is a partial sum over ranks."""

    def __init__(self, config: ModelConfig, layer: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.num_heads = local_heads(config, parallel)
        self.num_kv_heads = local_kv_heads(config, parallel)
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.window_of(layer)
        self.rope_index = 1 if config.local_rope is not None and self.window is not None else 0
        hidden, dim, bias = config.hidden_size, config.head_dim, config.attention_bias
        q = (config.num_heads, dim, False)
        kv = (config.num_kv_heads, dim, True)  # shared by several ranks if they outnumber it
        projs: list[nn.Linear]
        if config.fused_projections:
            self.qkv_proj = ColumnParallelLinear(hidden, [q, kv, kv], parallel, bias=bias)
            projs = [self.qkv_proj]
        else:
            self.q_proj = ColumnParallelLinear(hidden, [q], parallel, bias=bias)
            self.k_proj = ColumnParallelLinear(hidden, [kv], parallel, bias=bias)
            self.v_proj = ColumnParallelLinear(hidden, [kv], parallel, bias=bias)
            projs = [self.q_proj, self.k_proj, self.v_proj]
        self.o_proj = RowParallelLinear(config.num_heads, dim, hidden, parallel)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            offset = config.norm_unit_offset
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, unit_offset=offset)
        # One GEMM for q, k and v: their weights are row blocks of one buffer.
        self._projs = projs
        self.qkv = LinearWeights(projs)
        self.o = LinearWeights([self.o_proj])

    def linear_weights(self) -> list[LinearWeights]:
        return [self.qkv, self.o]

    @property
    def bias_params(self) -> list[dict[str, nn.Parameter | None]]:
        """The parameter dicts that hold the q/k/v biases (none without biases): a loader
        may replace a parameter object there, a sleep its storage."""
        return [p._parameters for p in self._projs if p.bias is not None]

    def qkv_bias(self) -> torch.Tensor | None:
        """The q/k/v biases as the one row block the fused product adds (None: no bias)."""
        if self._projs[0].bias is None:
            return None
        return fused_rows([p.bias for p in self._projs if p.bias is not None])

    def forward(self, x: torch.Tensor, step: StepContext, layer: int) -> torch.Tensor:
        rows = x.shape[0]
        bias = self.qkv_bias()
        qkv = step.gemm.linear(x, self.qkv, bias).view(rows, -1, self.head_dim)
        timers = step.gemm.timers
        if timers is None:
            out = self._attend(qkv, step, layer)
        else:
            with timers.attention():
                out = self._attend(qkv, step, layer)
        return step.gemm.linear(out.reshape(rows, -1), self.o)

    def _attend(self, qkv: torch.Tensor, step: StepContext, layer: int) -> torch.Tensor:
        """Rotate queries and keys, store keys and values, attend: ``[rows, heads, dim]``."""
        heads = self.num_heads + self.num_kv_heads
        cos, sin = step.rotary[self.rope_index]
        blocks = step.kv_cache.layer_heads(layer)
        stored = self._fuses(step, qkv, blocks, cos, sin)
        if stored:
            # One pass rotates queries and keys in place and stores keys and values.
            elementwise.rope_store_kv(
                qkv, self.num_heads, cos, sin, blocks, step.inputs.slot_mapping
            )
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads : heads]
        elif self.q_norm is None or self.k_norm is None:
            # Queries and keys rotate in one go; values are the last kv heads, unrotated.
            qk = apply_rotary(qkv[:, :heads], cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = apply_rotary(self.q_norm(qkv[:, : self.num_heads]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, self.num_heads : heads]), cos, sin)
        v = qkv[:, heads:]
        if not stored:
            write_kv(blocks, step.inputs.slot_mapping, k, v)
        return paged_attention(q, k, v, blocks, step.plans[self.window], self.scale)

    def _fuses(
        self,
        step: StepContext,
        qkv: torch.Tensor,
        blocks: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> bool:
        return (
            step.fused  # the kernels apply to this step's dtype and device
            and self.q_norm is None
            and qkv.is_contiguous()
            and blocks.dtype == qkv.dtype
            and cos.dtype == qkv.dtype
            and cos.is_contiguous()
            and sin.is_contiguous()
        )
