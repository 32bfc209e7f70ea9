"""``RopeConfig``: a model's rotary embedding parameters, read from its transformers config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tgengine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is one of ``SUPPORTED_ROPE_TYPES``.

    ``factor`` is used by "linear" and "llama3"; the ``*_freq_factor`` fields only by
    "llama3"; ``original_max_position_embeddings`` by "llama3" and "longrope" (Phi-3), whose
    positions below it rotate by ``short_factor`` and the others by ``long_factor``, cos and
    sin scaled by ``attention_factor``. ``partial_rotary_factor``: the share of each head's
    dimensions that rotates (the first ones).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0


def rope_config(hf: Any, max_pos: int, name: str, layer_type: str = "full_attention") -> RopeConfig:
    # transformers 5 keeps everything in rope_parameters; 4.x has rope_theta + rope_scaling.
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if isinstance(params.get(layer_type), dict):  # one set per layer type (Gemma 3)
        params = dict(params[layer_type])
    theta = float(params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # its name before transformers 4.43
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ModelLoadError(
            name, f"rope type {rope_type!r} is not supported (supported: {supported})"
        )
    partial = float(
        params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0
    )
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope(hf, params, theta, partial, max_pos)
    if partial != 1.0:
        raise ModelLoadError(name, f"partial_rotary_factor with rope type {rope_type!r}")
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=theta, factor=factor)
    return RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_pos
        ),
    )


def _longrope(
    hf: Any, params: dict[str, Any], theta: float, partial: float, max_pos: int
) -> RopeConfig:
    original = int(
        params.get("original_max_position_embeddings")
        or getattr(hf, "original_max_position_embeddings", None)
        or max_pos
    )
    factor = float(params.get("factor") or max_pos / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeConfig(
        rope_type="longrope",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention_factor),
        partial_rotary_factor=partial,
    )
