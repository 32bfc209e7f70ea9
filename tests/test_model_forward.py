"""tgengine's own paged forward against transformers (the reference), plus config and loading."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tgengine.errors import ModelLoadError
from tgengine.models import (
    CausalLM,
    ForwardInputs,
    KVCache,
    PrefillSpan,
    iter_safetensors,
    load_model,
    load_model_config,
    load_weights,
    resolve_dtype,
    weight_specs,
)
from tgengine.models.rope import inv_frequencies

from model_factory import make_tiny_model_dir, read_config, write_config

BLOCK_SIZE = 4
ATOL = 1e-4


class Pager:
    """Lays sequences out in shuffled KV blocks and builds each step's ``ForwardInputs``."""

    def __init__(self, num_blocks: int = 64, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]]) -> ForwardInputs:
        """``work``: (seq_id, new token ids) per sequence; one token on a cached seq = decode."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        for seq_id, new in work:
            cached = self.lengths.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            total = cached + len(new)
            while len(table) * BLOCK_SIZE < total:
                table.append(self.free.pop())
            start = len(ids)
            for pos in range(cached, total):
                positions.append(pos)
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids.extend(new)
            if len(new) == 1 and cached > 0:
                decode_rows.append(start)
                decode_tables.append(list(table))
                decode_lens.append(total)
            else:
                block_table = torch.tensor(table, dtype=torch.int64)
                prefills.append(PrefillSpan(start, len(ids), total, block_table))
            logits_rows.append(len(ids) - 1)
            self.lengths[seq_id] = total
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        return ForwardInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64),
            decode_block_tables=torch.tensor(padded, dtype=torch.int64).reshape(len(padded), width),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64),
            prefills=prefills,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        )


class Pair:
    """Our model and its cache next to the transformers reference loaded from the same dir."""

    def __init__(self, model_dir: Path, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.config = load_model_config(model_dir)
        torch_dtype = resolve_dtype(dtype, self.config)
        self.model = load_model(self.config, model_dir, torch_dtype, "cpu")
        self.cache = KVCache.allocate(self.config, 64, BLOCK_SIZE, torch_dtype, "cpu")
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
        self.pager = Pager()

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(self.pager.step(work), self.cache)

    def reference(self, tokens: list[int]) -> torch.Tensor:
        """Transformers' float32 logits of the last token of ``tokens``."""
        with torch.inference_mode():
            return self.ref(torch.tensor([tokens])).logits[0, -1].float()


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_match(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    assert int(ours.argmax()) == int(ref.argmax())


def check_prefill_then_decode(pair: Pair, lengths: list[int], num_decodes: int = 3) -> None:
    seqs = prompts(pair.config.vocab_size, lengths)
    logits = pair.step(list(enumerate(seqs)))
    assert logits.shape == (len(seqs), pair.config.vocab_size)
    assert logits.dtype == torch.float32
    for i, seq in enumerate(seqs):
        assert_match(logits[i], pair.reference(seq))
    for _ in range(num_decodes):
        for i, seq in enumerate(seqs):
            seq.append(int(logits[i].argmax()))
        logits = pair.step([(i, seq[-1:]) for i, seq in enumerate(seqs)])
        for i, seq in enumerate(seqs):
            assert_match(logits[i], pair.reference(seq))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_prefill_batch_then_batched_decode(fixture: str, request: pytest.FixtureRequest) -> None:
    check_prefill_then_decode(Pair(request.getfixturevalue(fixture)), [3, 4, 9, 13])


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_chunked_prefill_mixed_with_decode(fixture: str, request: pytest.FixtureRequest) -> None:
    pair = Pair(request.getfixturevalue(fixture))
    long, short = prompts(pair.config.vocab_size, [14, 6])
    first = pair.step([(1, short), (0, long[:5])])
    assert_match(first[0], pair.reference(short))
    assert_match(first[1], pair.reference(long[:5]))
    short.append(int(first[0].argmax()))
    # A decode row and a prefill chunk that reads a cached prefix, in one step.
    second = pair.step([(0, long[5:9]), (1, short[-1:])])
    assert_match(second[0], pair.reference(long[:9]))
    assert_match(second[1], pair.reference(short))
    third = pair.step([(0, long[9:])])
    assert_match(third[0], pair.reference(long))


def test_all_rows_logits_when_logits_rows_is_none(tiny_llama_dir: Path) -> None:
    pair = Pair(tiny_llama_dir)
    (seq,) = prompts(pair.config.vocab_size, [7])
    inputs = pair.pager.step([(0, seq)])
    inputs.logits_rows = None
    with torch.inference_mode():
        logits = pair.model(inputs, pair.cache)
        ref = pair.ref(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # With head_dim 16 this puts frequencies in all three llama3 bands.
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant: str, tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = ROPE_VARIANTS[variant]
    model_dir = make_tiny_model_dir(tmp_path, arch="llama", rope_parameters=dict(params))
    config = load_model_config(model_dir)
    assert config.rope.rope_type == variant
    expected, _ = ROPE_INIT_FUNCTIONS[variant](AutoConfig.from_pretrained(model_dir))
    torch.testing.assert_close(inv_frequencies(config.rope, config.head_dim), expected)
    check_prefill_then_decode(Pair(model_dir), [11, 18], num_decodes=2)


def test_legacy_rope_scaling_keys_are_read(tiny_llama_dir: Path, tmp_path: Path) -> None:
    raw = read_config(tiny_llama_dir)
    raw.pop("rope_parameters")
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 4.0}
    write_config(tmp_path, raw)
    config = load_model_config(tmp_path)
    assert (config.rope.rope_type, config.rope.factor, config.rope_theta) == (
        "linear",
        4.0,
        500000.0,
    )


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path, arch="mistral", sliding_window=5)
    pair = Pair(model_dir)
    assert pair.config.sliding_window == 5
    check_prefill_then_decode(pair, [4, 12], num_decodes=2)


def test_sharded_safetensors_load(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path, arch="qwen2", max_shard_size="40KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert not (model_dir / "model.safetensors").exists()
    names = {name for name, _ in iter_safetensors(model_dir)}
    model = load_model(load_model_config(model_dir), model_dir, torch.float32, "cpu")
    assert names == set(weight_specs(model))
    check_prefill_then_decode(Pair(model_dir), [6], num_decodes=1)


def test_config_fields(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = load_model_config(tiny_llama_dir)
    qwen2 = load_model_config(tiny_qwen2_dir)
    assert (llama.model_type, qwen2.model_type) == ("llama", "qwen2")
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert not llama.tie_word_embeddings and qwen2.tie_word_embeddings
    assert not llama.attention_bias and qwen2.attention_bias
    assert llama.torch_dtype == torch.float32
    assert llama.eos_token_ids == (0,) and llama.bos_token_id == 0
    specs = weight_specs(CausalLM(qwen2))
    assert "lm_head.weight" not in specs
    assert "model.layers.0.self_attn.q_proj.bias" in specs


def test_eos_ids_merge_config_and_generation_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    write_config(tmp_path, {**read_config(tiny_llama_dir), "eos_token_id": [5, 0]})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    assert load_model_config(tmp_path).eos_token_ids == (5, 0, 7)


def test_unsupported_model_type(tiny_llama_dir: Path, tmp_path: Path) -> None:
    write_config(tmp_path, {**read_config(tiny_llama_dir), "model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match="model type 'gpt2' is not supported"):
        load_model_config(tmp_path)


def test_qwen2_sliding_window_is_refused(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    raw = {**read_config(tiny_qwen2_dir), "use_sliding_window": True, "sliding_window": 8}
    write_config(tmp_path, raw)
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("missing_dir", "directory does not exist"),
        ("no_config", "config.json not found"),
        ("broken_json", "config.json is not valid JSON"),
    ],
)
def test_broken_model_dir(setup: str, reason: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    if setup != "missing_dir":
        model_dir.mkdir()
    if setup == "broken_json":
        (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=reason) as info:
        load_model_config(model_dir)
    assert "\n" not in str(info.value)


def test_load_weights_errors(tiny_llama_dir: Path) -> None:
    model = load_model(load_model_config(tiny_llama_dir), tiny_llama_dir, "auto", "cpu")
    weight = torch.zeros(model.model.norm.weight.shape)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.bogus\.weight'"):
        load_weights(model, [("model.bogus.weight", weight)], strict=False)
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(3,\)"):
        load_weights(model, [("model.norm.weight", torch.zeros(3))], strict=False)
    with pytest.raises(ModelLoadError, match="missing tensor"):
        load_weights(model, [("model.norm.weight", weight)], strict=True)
    extras = [("model.rotary_emb.inv_freq", torch.zeros(8)), ("model.norm.weight", weight + 2)]
    assert load_weights(model, extras, strict=False) == {"model.norm.weight"}
    assert torch.equal(model.model.norm.weight, weight + 2)


def test_no_weights_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    write_config(tmp_path, read_config(tiny_llama_dir))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(load_model_config(tmp_path), tmp_path, "float32", "cpu")


def test_dtypes(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = load_model_config(tiny_llama_dir)
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype("float16", config) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float64", config)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    write_config(tmp_path, {**read_config(tiny_llama_dir), "dtype": "bfloat16"})
    assert resolve_dtype("auto", load_model_config(tmp_path)) == torch.bfloat16
    pair = Pair(tmp_path, dtype="auto")
    assert {p.dtype for p in pair.model.parameters()} == {torch.bfloat16}
    assert pair.cache.kv.dtype == torch.bfloat16
    (seq,) = prompts(pair.config.vocab_size, [9])
    logits = pair.step([(0, seq)])[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, pair.reference(seq), atol=0.1, rtol=0)


def test_kv_cache_sizes(tiny_qwen2_dir: Path) -> None:
    config = load_model_config(tiny_qwen2_dir)
    cache = KVCache.allocate(config, 10, BLOCK_SIZE, torch.float16, "cpu")
    assert cache.kv.shape == (2, 2, 40, 2, 16)
    assert (cache.num_blocks, cache.block_size) == (10, BLOCK_SIZE)
    assert cache.nbytes == 10 * KVCache.bytes_per_block(config, BLOCK_SIZE, torch.float16)
    assert KVCache.bytes_per_block(config, BLOCK_SIZE, torch.float16) == 2 * 2 * 4 * 2 * 16 * 2


def test_tied_model_ignores_checkpoint_lm_head(tiny_qwen2_dir: Path) -> None:
    model = load_model(load_model_config(tiny_qwen2_dir), tiny_qwen2_dir, "float32", "cpu")
    embed = model.model.embed_tokens.weight.clone()
    named = [("lm_head.weight", torch.zeros_like(embed))]
    assert load_weights(model, named, strict=False) == set()
    assert torch.equal(model.model.embed_tokens.weight, embed)
