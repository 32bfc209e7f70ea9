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


def write_synthetic_model(path: str | Path, *, seed: int = 0) -> Path:
    """Write a random SmolLM2-135M-shaped Llama (bfloat16 safetensors) into ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_135M, dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(path))
    _byte_tokenizer(path)
    return path


if __name__ == "__main__":
    import sys

    print(write_synthetic_model(sys.argv[1] if len(sys.argv) > 1 else "synthetic-smollm2"))
