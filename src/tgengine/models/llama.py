"""``CausalLM``: tgengine's own forward for Llama-family decoders (Llama, Mistral, Qwen2).

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...) so a
checkpoint loads by name. The forward reads one ``ForwardInputs`` (all sequences' rows
concatenated), writes each layer's keys and values into the paged ``KVCache``, and returns
float32 logits for ``inputs.logits_rows`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tgengine.models import kernels
from tgengine.models.attention import AttentionPlan, paged_attention, write_kv
from tgengine.models.config import ModelConfig
from tgengine.models.fused import fused_rows
from tgengine.models.gemm import Gemm, LinearWeights
from tgengine.models.inputs import ForwardInputs
from tgengine.models.kv_cache import KVCache
from tgengine.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before scaling, as transformers does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


@dataclass
class StepContext:
    """What every layer reads during one forward, besides its hidden states."""

    inputs: ForwardInputs
    plan: AttentionPlan
    kv_cache: KVCache
    cos: torch.Tensor
    sin: torch.Tensor
    gemm: Gemm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        # One GEMM for q, k and v: their weights are row blocks of one buffer.
        self.qkv = LinearWeights([self.q_proj, self.k_proj, self.v_proj])
        self.o = LinearWeights([self.o_proj])

    def linear_weights(self) -> list[LinearWeights]:
        return [self.qkv, self.o]

    def forward(self, x: torch.Tensor, step: StepContext, layer: int) -> torch.Tensor:
        rows = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = fused_rows([p.bias for p in projs]) if self.q_proj.bias is not None else None
        qkv = step.gemm.linear(x, self.qkv, bias).view(rows, -1, self.head_dim)
        # Queries and keys rotate in one go; values are the last kv heads, unrotated.
        qk = apply_rotary(qkv[:, : self.num_heads + self.num_kv_heads], step.cos, step.sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        blocks = step.kv_cache.layer_heads(layer)
        write_kv(blocks, step.inputs.slot_mapping, k, v)
        out = paged_attention(q, k, v, blocks, step.plan, self.scale)
        return step.gemm.linear(out.reshape(rows, -1), self.o)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up = LinearWeights([self.gate_proj, self.up_proj])
        self.down = LinearWeights([self.down_proj])

    def linear_weights(self) -> list[LinearWeights]:
        return [self.gate_up, self.down]

    def forward(self, x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        gate, up = gemm.linear(x, self.gate_up).chunk(2, dim=-1)
        return gemm.linear(F.silu(gate) * up, self.down)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: StepContext, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, layer)
        return x + self.mlp(self.post_attention_layernorm(x), step.gemm)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family decoder with a paged KV cache.

    Build it (on the ``meta`` device if you like) and fill it with ``load_weights``;
    parameters never require grad. Call ``forward`` under ``torch.inference_mode()``.

    ``gemm`` picks the kernel of each linear product (see ``models.gemm``). With
    ``gemm.prepack`` on, ``models.weights.pack_weights`` replaces the linear weights by their
    packed form (one copy: the parameters then hold placeholders); change weights after
    that only through ``models.weights`` (``copy_weights``), which unpacks what it writes.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.head = LinearWeights([self.lm_head]) if self.lm_head is not None else None
        self.gemm = Gemm()
        self.use_kernels = True
        """Use tgengine's compiled CPU kernels where they apply (``models.kernels``)."""
        self.requires_grad_(False)

    def _kernel_fits(self, kv_cache: KVCache) -> bool:
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        return kernels.supports(kv_cache.kv.device, kv_cache.kv.dtype, c.head_dim, groups)

    def linear_weights(self) -> list[LinearWeights]:
        """Every linear product's weight (the tied head, which the embedding reads, excluded)."""
        found: list[LinearWeights] = []
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            found += [*layer.self_attn.linear_weights(), *layer.mlp.linear_weights()]
        return [*found, self.head] if self.head is not None else found

    def forward(self, inputs: ForwardInputs, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab_size]`` (all rows if it is None).

        Side effect: every row's keys and values are written to ``kv_cache`` at
        ``inputs.slot_mapping``, in every layer.
        """
        x = self.model.embed_tokens(inputs.input_ids)
        cos, sin = self.rotary.cos_sin(inputs.positions, x.dtype)
        plan = AttentionPlan.build(
            inputs,
            kv_cache.block_size,
            self.config.sliding_window,
            use_kernel=self.use_kernels and self._kernel_fits(kv_cache),
        )
        step = StepContext(inputs, plan, kv_cache, cos, sin, self.gemm)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, step, i)
        if inputs.logits_rows is not None:
            x = x[inputs.logits_rows]
        x = self.model.norm(x)
        head = self.head if self.head is not None else self.model.embed_tokens.weight
        return self.gemm.linear(x, head).float()
