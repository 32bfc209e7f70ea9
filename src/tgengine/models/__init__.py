"""Llama-family models: config, paged KV cache, tgengine's own forward, and weight loading."""

from __future__ import annotations

from tgengine.models.causal_lm import CausalLM
from tgengine.models.config import ModelConfig, RopeConfig, resolve_dtype
from tgengine.models.config_loader import load_model_config
from tgengine.models.inputs import ForwardInputs, PrefillSpan
from tgengine.models.kv_cache import KVCache
from tgengine.models.loader import (
    iter_safetensors,
    iter_stored,
    load_model,
    load_weights,
    weight_specs,
)

__all__ = [
    "CausalLM",
    "ForwardInputs",
    "KVCache",
    "ModelConfig",
    "PrefillSpan",
    "RopeConfig",
    "iter_safetensors",
    "iter_stored",
    "load_model",
    "load_model_config",
    "load_weights",
    "resolve_dtype",
    "weight_specs",
]
