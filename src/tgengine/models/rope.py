"""Rotary position embeddings (default, linear, llama3 and longrope), as transformers computes them.

The inverse frequencies are computed in float32 exactly like transformers'
``modeling_rope_utils`` and applied with the rotate-half convention, to the first
``rotary_dim`` dimensions of each head (all of them unless ``partial_rotary_factor`` < 1).

Longrope (Phi-3) rotates each position by its own rule: positions below
``original_max_position_embeddings`` by the short factors, the others by the long ones, so a
position's keys never depend on the sequence's length (prefix caching, chunked prefill and
preemption stay exact). transformers instead rotates *every* position of a sequence longer
than that by the long factors (it recomputes the whole cache when a sequence crosses it);
both agree on sequences that stay within it.
"""

from __future__ import annotations

import math

import torch

from tgengine.models.rope_params import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def inv_frequencies(rope: RopeConfig, head_dim: int, *, long: bool = False) -> torch.Tensor:
    """The ``[rotary_dim // 2]`` float32 inverse frequencies on the CPU.

    ``long``: longrope's frequencies past ``original_max_position_embeddings``.
    """
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, device="cpu")
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Computes ``(cos, sin)`` for a step's positions; holds no parameters.

    The frequencies are a plain tensor, not a buffer, so building the model on the meta
    device and materialising it later never loses them; they follow the positions' device.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.inv_freq = inv_frequencies(rope, head_dim)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = rope.original_max_position_embeddings
        self.attention_factor = rope.attention_factor
        if rope.rope_type == "longrope":
            self.long_inv_freq = inv_frequencies(rope, head_dim, long=True)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of shape ``[T, rotary_dim]``, computed in float32, cast to dtype."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(positions.device)
            is_long = (positions >= self.long_from)[:, None]
            inv_freq = torch.where(is_long, self.long_inv_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-row ``cos``/``sin`` ``[T, rotary_dim]``.

    Dimensions past ``rotary_dim`` pass through unrotated.
    """
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)
