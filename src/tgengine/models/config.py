"""``ModelConfig``: what tgengine needs from a Hugging Face ``config.json``, read once.

``models.config_loader.load_model_config`` builds it (``build_config``) from transformers'
``AutoConfig``; everything downstream (model, KV cache, engine limits) reads the plain frozen
dataclass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tgengine.errors import ModelLoadError
from tgengine.models.rope_params import RopeConfig, rope_config

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts feed-forward block: ``top_k`` of ``num_experts`` per token.

    Routing is a softmax over the router's logits, the ``top_k`` largest kept, renormalised to
    sum to 1 when ``normalize_top_k``. ``sparse_layers[i]`` says whether layer ``i`` has this
    block (else a dense MLP of ``ModelConfig.intermediate_size``). ``block_name`` and
    ``expert_names`` (gate, up, down) are the checkpoint's module names.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    sparse_layers: tuple[bool, ...]
    block_name: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape, constants and variant features, independent of transformers' classes.

    The variant fields default to Llama's behaviour; ``models.architectures`` sets them per
    supported architecture.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # keys older than this many positions are not attended
    torch_dtype: torch.dtype | None = None  # the checkpoint's dtype, if config.json says
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    model_dir: str = ""
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight) (Gemma)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()  # per-layer window; (): sliding_window for all
    local_rope: RopeConfig | None = None  # RoPE of the windowed layers, if it differs
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    fused_projections: bool = False  # checkpoint has qkv_proj and gate_up_proj (Phi-3)
    moe: MoEConfig | None = None

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The widest window when every layer is local (older KV is read by no layer), or None."""
        windows = [self.window_of(layer) for layer in range(self.num_layers)]
        return None if None in windows else max(w for w in windows if w is not None)


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """Map an ``EngineConfig.dtype`` string to a torch dtype.

    ``"auto"`` is the checkpoint's dtype when it is float32, bfloat16 or float16, else float32.
    """
    if dtype == "auto":
        if config.torch_dtype in _DTYPES.values():
            return config.torch_dtype  # type: ignore[return-value]
        return torch.float32
    if dtype not in _DTYPES:
        choices = ", ".join(["auto", *_DTYPES])
        raise ValueError(f"dtype: expected one of {choices}, got {dtype!r}")
    return _DTYPES[dtype]


def build_config(hf: Any, model_type: str, path: Path) -> ModelConfig:
    name = str(path)
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(
            name, f"hidden_act {act!r} is not supported (supported: silu, gelu_pytorch_tanh)"
        )
    num_heads = int(hf.num_attention_heads)
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    if num_heads % num_kv_heads != 0:
        raise ModelLoadError(
            name, f"num_attention_heads {num_heads} is not a multiple of kv heads {num_kv_heads}"
        )
    max_pos = int(hf.max_position_embeddings)
    gen = read_json(path, "generation_config.json", required=False)
    eos = _token_ids(getattr(hf, "eos_token_id", None)) + _token_ids(gen.get("eos_token_id"))
    bos = getattr(hf, "bos_token_id", None)
    if bos is None:
        bos = gen.get("bos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope=rope_config(hf, max_pos, name),
        # Qwen2 always has q/k/v bias (its config has no flag); Llama reads attention_bias.
        attention_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        sliding_window=_sliding_window(hf, model_type, max_pos, name),
        torch_dtype=_config_dtype(hf),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        model_dir=name,
        hidden_act=act,
    )


def _sliding_window(hf: Any, model_type: str, max_pos: int, name: str) -> int | None:
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen's window applies only to some layers (max_window_layers): not supported.
        if getattr(hf, "use_sliding_window", False):
            raise ModelLoadError(
                name, f"{model_type} with use_sliding_window=true is not supported"
            )
        return None
    window = getattr(hf, "sliding_window", None)
    if window is None or int(window) >= max_pos:
        return None
    return int(window)


def _config_dtype(hf: Any) -> torch.dtype | None:
    value = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _token_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def read_json(path: Path, filename: str, *, required: bool) -> dict[str, Any]:
    name = str(path)
    if not path.exists():
        raise ModelLoadError(name, "directory does not exist")
    if not path.is_dir():
        raise ModelLoadError(name, "not a directory")
    file = path / filename
    if not file.is_file():
        if required:
            raise ModelLoadError(name, f"{filename} not found")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(name, f"{filename} is not valid JSON: {one_line(exc)}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(name, f"{filename} is not a JSON object")
    return data


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
