"""``CausalLM``: tgengine's own forward for Llama-family decoders (Llama, Mistral, Qwen2).

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...) so a
checkpoint loads by name. The forward reads one ``ForwardInputs`` (all sequences' rows
concatenated), writes each layer's keys and values into the paged ``KVCache``, and returns
float32 logits for ``inputs.logits_rows`` only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tgengine.models.attention import paged_attention, write_kv
from tgengine.models.config import ModelConfig
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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inputs: ForwardInputs,
        kv_cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        write_kv(kv_cache.kv[layer], inputs.slot_mapping, k, v)
        blocks = kv_cache.layer_blocks(layer)
        out = paged_attention(q, k, v, blocks, inputs, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inputs: ForwardInputs,
        kv_cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, inputs, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


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
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.requires_grad_(False)

    def forward(self, inputs: ForwardInputs, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits ``[len(inputs.logits_rows), vocab_size]`` (all rows if it is None).

        Side effect: every row's keys and values are written to ``kv_cache`` at
        ``inputs.slot_mapping``, in every layer.
        """
        x = self.model.embed_tokens(inputs.input_ids)
        cos, sin = self.rotary.cos_sin(inputs.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, inputs, kv_cache, i)
        if inputs.logits_rows is not None:
            x = x[inputs.logits_rows]
        x = self.model.norm(x)
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(x, head).float()
