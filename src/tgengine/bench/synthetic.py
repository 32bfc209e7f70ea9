"""A random-weight model with a real model's shape, for performance checks without downloads.

Speed depends on the shape, not on the weights, so a machine that cannot fetch the default
model (no network) still measures what matters. The tokenizer is byte-level without merges
(259 ids); the model's larger vocabulary is fine, since the benches feed token ids, and
decoding skips ids the tokenizer does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct's shape (config.json of HuggingFaceTB/SmolLM2-135M-Instruct).
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


# A small Qwen3-MoE (Qwen3-30B-A3B's layout: 128 experts, top-8, q/k norms, scaled down).
QWEN3_MOE_TINY: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def _byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(str(path))


def write_synthetic_model(path: str | Path, *, seed: int = 0, moe: bool = False) -> Path:
    """Write a random SmolLM2-135M-shaped Llama (bfloat16 safetensors) into ``path``.

    ``moe``: a small Qwen3-MoE instead (``QWEN3_MOE_TINY``), for the benches' MoE runs.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen3MoeConfig

    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if moe:
        config: Any = Qwen3MoeConfig(**QWEN3_MOE_TINY, dtype="bfloat16")
    else:
        config = LlamaConfig(**SMOLLM2_135M, dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(path))
    _byte_tokenizer(path)
    return path


if __name__ == "__main__":
    import sys

    moe = "--moe" in sys.argv[1:]
    args = [a for a in sys.argv[1:] if a != "--moe"]
    default = "synthetic-qwen3-moe" if moe else "synthetic-smollm2"
    print(write_synthetic_model(args[0] if args else default, moe=moe))
