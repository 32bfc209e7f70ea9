"""The supported architectures, by ``config.json``'s ``architectures`` entry, as configuration.

Every architecture runs on the one decoder in ``models.causal_lm``; what differs between them is
data: ``features`` returns the ``ModelConfig`` fields that switch its variant layers on (q/k
norms, Gemma's norms and scales, per-layer windows, fused checkpoint projections, experts).
"""

from __future__ import annotations

from typing import Any

from tgengine.errors import ModelLoadError
from tgengine.models.config import ModelConfig, MoEConfig
from tgengine.models.rope_params import rope_config

# architecture -> the model_type its config.json carries
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def architecture_of(raw: dict[str, Any], name: str) -> str:
    """The supported architecture a raw ``config.json`` names, else ``ModelLoadError``.

    Without an ``architectures`` entry the ``model_type`` decides.
    """
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ModelLoadError(name, "config.json has no model_type")
    listed = raw.get("architectures")
    if isinstance(listed, list) and listed and isinstance(listed[0], str):
        architecture = listed[0]
        if architecture not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise ModelLoadError(
                name, f"architecture {architecture!r} is not supported (supported: {supported})"
            )
    else:
        by_type = {t: a for a, t in ARCHITECTURES.items()}
        architecture = by_type.get(model_type, "")
    if model_type not in ARCHITECTURES.values() or (
        architecture and ARCHITECTURES[architecture] != model_type
    ):
        supported = ", ".join(dict.fromkeys(ARCHITECTURES.values()))
        raise ModelLoadError(
            name, f"model type {model_type!r} is not supported (supported: {supported})"
        )
    return architecture


def features(hf: Any, architecture: str, base: ModelConfig) -> dict[str, Any]:
    """The ``ModelConfig`` fields ``architecture`` sets beyond the Llama defaults of ``base``."""
    name = base.model_dir
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        found: dict[str, Any] = {"qk_norm": True}
        if architecture == "Qwen3MoeForCausalLM":
            found["moe"] = _qwen3_moe(hf, base.num_layers)
        return found
    if architecture == "MixtralForCausalLM":
        return {"moe": _mixtral(hf, base.num_layers)}
    if architecture == "Phi3ForCausalLM":
        return {"fused_projections": True}
    if architecture == "Gemma3ForCausalLM":
        return _gemma3(hf, base, name)
    return {}


def _qwen3_moe(hf: Any, num_layers: int) -> MoEConfig:
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    num_experts = int(hf.num_experts)
    sparse = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        normalize_top_k=bool(hf.norm_topk_prob),
        sparse_layers=sparse,
    )


def _mixtral(hf: Any, num_layers: int) -> MoEConfig:
    return MoEConfig(
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.intermediate_size),
        normalize_top_k=True,
        sparse_layers=(True,) * num_layers,
        block_name="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
    )


def _gemma3(hf: Any, base: ModelConfig, name: str) -> dict[str, Any]:
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError(name, "gemma3 with attn_logit_softcapping is not supported")
    window = getattr(hf, "sliding_window", None)
    layer_types = list(hf.layer_types)
    windows = tuple(
        int(window) if t == "sliding_attention" and window is not None else None
        for t in layer_types
    )
    cap = getattr(hf, "final_logit_softcapping", None)
    max_pos = base.max_position_embeddings
    return {
        "qk_norm": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": float(base.hidden_size) ** 0.5,
        "query_scale": float(hf.query_pre_attn_scalar) ** -0.5,
        "sliding_window": None,
        "layer_windows": windows,
        "rope": rope_config(hf, max_pos, name, "full_attention"),
        "local_rope": rope_config(hf, max_pos, name, "sliding_attention"),
        "final_logit_softcapping": float(cap) if cap is not None else None,
    }
