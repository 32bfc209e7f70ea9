"""Layers every architecture shares: RMSNorm (plain or Gemma's ``1 + w``) and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tgengine.kernels import elementwise
from tgengine.models.gemm import Gemm, LinearWeights
from tgengine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from tgengine.runtime.parallel import ParallelContext


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32 as transformers does.

    Plain (Llama, Qwen, Mistral, Phi-3): ``weight * normed.to(dtype)``. With ``unit_offset``
    (Gemma): ``(normed * (1 + weight)).to(dtype)``, the weight stored as its offset from 1.
    """

    def __init__(self, size: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, fused: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; ``(norm(x), x)`` when ``residual`` is None.

        ``fused``: in one compiled pass where it applies (``kernels.elementwise``), which
        writes the sum into ``residual`` in place: pass only a residual stream you own.
        """
        if fused and self._fuses(x, residual):
            return elementwise.add_rms_norm(
                x, residual, self.weight, self.eps, unit_offset=self.unit_offset
            ), (x if residual is None else residual)
        if residual is not None:
            x = residual + x
        return self(x), x

    def _fuses(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            elementwise.applies(x)
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))
        )


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP's gate activation: ``silu`` or ``gelu_pytorch_tanh``."""
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; gate and up are one GEMM over their fused rows.

    ``names`` are the checkpoint's module names (gate, up, down); with ``fused`` the checkpoint
    holds gate and up as one ``gate_up_proj`` (Phi-3), which is then the one row block.
    With tensor parallelism each rank holds its share of the intermediate rows, and the
    output is a partial sum over ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        *,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
        fused: bool = False,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.act = act
        parallel = parallel or ParallelContext()
        gate_name, up_name, down_name = names
        rows = (intermediate_size, 1, False)
        blocks: list[nn.Linear]
        if fused:
            gate_up = ColumnParallelLinear(hidden_size, [rows, rows], parallel)
            self.add_module("gate_up_proj", gate_up)
            blocks = [gate_up]
        else:
            gate = ColumnParallelLinear(hidden_size, [rows], parallel)
            up = ColumnParallelLinear(hidden_size, [rows], parallel)
            self.add_module(gate_name, gate)
            self.add_module(up_name, up)
            blocks = [gate, up]
        down = RowParallelLinear(intermediate_size, 1, hidden_size, parallel)
        self.add_module(down_name, down)
        self.gate_up = LinearWeights(blocks)
        self.down = LinearWeights([down])

    def linear_weights(self) -> list[LinearWeights]:
        return [self.gate_up, self.down]

    def forward(self, x: torch.Tensor, gemm: Gemm, *, fused: bool = False) -> torch.Tensor:
        """``fused``: ``act(gate) * up`` in one compiled pass where it applies."""
        gate_up = gemm.linear(x, self.gate_up)
        if fused and self.act in elementwise.ACTIVATIONS and elementwise.applies(gate_up):
            return gemm.linear(elementwise.act_mul(gate_up.contiguous(), self.act), self.down)
        gate, up = gate_up.chunk(2, dim=-1)
        return gemm.linear(activation(self.act, gate) * up, self.down)
