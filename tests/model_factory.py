"""Tiny random Hugging Face model directories for tests (no hub access, well under a second).

``make_tiny_model_dir(path, arch="llama")`` writes ``config.json``, ``model.safetensors`` (or
shards plus ``model.safetensors.index.json``), ``generation_config.json`` and a byte-level BPE
tokenizer trained on a small built-in corpus, so that ``AutoConfig``, ``AutoTokenizer`` and
``AutoModelForCausalLM`` all load the directory offline.

Llama is untied (``lm_head.weight`` present) and Qwen2 is tied with q/k/v bias, so both
layouts are covered. Weights use a large initializer range so greedy argmaxes are well
separated and parity tests compare them reliably.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

BOS_EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_EOS, IM_START, IM_END)
VOCAB_SIZE = 384

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
Once upon a time there was a small engine that served language models to many people.
It read a prompt, computed the key and value cache, and then produced one token at a time.
The scheduler decided which requests ran in each step, and the block manager kept track of
the memory. When the cache was full, the newest request waited until another one finished.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 appear in text, as do symbols: + - * / = % $.
Paris is the capital of France. The sun rises in the east and sets in the west.
A user asked a question, and the assistant answered politely and briefly.
Python is a programming language; tensors live on devices; tests keep the code honest.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process; the result is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def make_tokenizer(path: Path) -> Any:
    """Write a byte-level BPE tokenizer (with a chat template) to ``path``; return it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS_EOS,
        eos_token=BOS_EOS,
        pad_token=BOS_EOS,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _config(arch: str, vocab_size: int, bos: int, eos: int, overrides: dict[str, Any]) -> Any:
    import transformers
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if arch == "llama":
        return LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    if arch == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    if arch == "mistral":
        defaults = {"tie_word_embeddings": False, "sliding_window": None}
        return MistralConfig(**{**common, **defaults, **overrides})
    if arch in _NEW_ARCHS:
        class_name, defaults = _NEW_ARCHS[arch]
        config_class = getattr(transformers, class_name)
        return config_class(**{**common, **defaults, **overrides})
    raise ValueError(
        f"arch: unknown {arch!r} (known: llama, mistral, qwen2, {', '.join(_NEW_ARCHS)})"
    )


# Later architectures: head_dim 32 (explicit, unlike hidden/heads = 16, and one the compiled
# decode kernel takes), untied heads unless the family ties them.
_NEW_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_hidden_layers": 3,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        },
    ),
}


def make_tiny_model_dir(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` model (float32) plus tokenizer into ``path``; return it.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=3`` or
    ``rope_parameters={...}``). ``max_shard_size`` (e.g. ``"40KB"``) writes sharded
    safetensors with an index file.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tokenizer = make_tokenizer(path)
    bos = int(tokenizer.convert_tokens_to_ids(BOS_EOS))
    eos = bos
    config = _config(arch, len(tokenizer), bos, eos, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch in _NEW_ARCHS:
        _perturb_small_tensors(model, seed)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    GenerationConfig(bos_token_id=bos, eos_token_id=[eos], pad_token_id=eos).save_pretrained(
        str(path)
    )
    return path


def _perturb_small_tensors(model: Any, seed: int) -> None:
    """Give norms and routers random values, so a parity test exercises them.

    transformers initialises norm weights to ones (or zeros for Gemma's ``1 + w``) and some
    routers to zeros, under which a wrong norm variant or routing would go unnoticed.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a model directory, as a dict (handy for tests that edit it)."""
    return dict(json.loads((Path(path) / "config.json").read_text()))


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Overwrite the ``config.json`` of a model directory."""
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
