"""Qwen3, Phi-3, Gemma 3, Mixtral and Qwen3-MoE against transformers, on tiny random models.

Each architecture: the paged forward's logits equal transformers' (prefill, batched decode,
a chunk over a cached prefix); greedy tokens through the engine equal transformers'
``generate`` with prefix caching, chunked prefill and preemption all in play, with a clear
top-1 margin at every reference step; bf16 runs; checkpoint names are the model's names.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from test_model_forward import Pair, assert_match, check_prefill_then_decode, prompts
from tgengine import open_engine
from tgengine.errors import ModelLoadError
from tgengine.models import iter_safetensors, load_model, load_model_config, weight_specs
from tgengine.models.config import MoEConfig
from tgengine.models.gemm import Gemm
from tgengine.models.moe import SparseMoE

from engine_helpers import (
    TIMEOUT,
    generate_all,
    greedy,
    hf_greedy_with_margin,
    make_prompts,
    tiny_config,
    tokens_of,
)
from model_factory import make_tiny_model_dir, read_config, write_config

LONGROPE_FROM = 64
# name: (factory arch, config overrides)
ARCHS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {"sliding_window": 12}),
    "phi3": ("phi3", {}),
    # Longrope with half the head rotating; the sequences stay within the short factors'
    # range (test_longrope_long_factors checks the long ones).
    "phi3-longrope": (
        "phi3",
        {
            "original_max_position_embeddings": LONGROPE_FROM,
            "partial_rotary_factor": 0.5,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.3, 1.7, 2.5],
                "long_factor": [3.0, 5.0, 9.0, 17.0],
            },
        },
    ),
    "gemma3": ("gemma3", {}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}
MAX_TOKENS = 10
MIN_MARGIN = 1e-3  # logit gap between the reference's top two tokens, at every step


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = ARCHS[str(request.param)]
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return make_tiny_model_dir(path, arch=arch, **overrides)


def test_forward_matches_transformers(arch_dir: Path) -> None:
    pair = Pair(arch_dir)
    check_prefill_then_decode(pair, [3, 9, 14], num_decodes=3)
    long = prompts(pair.config.vocab_size, [11], seed=7)[0]
    pair.step([(9, long[:6])])
    assert_match(pair.step([(9, long[6:])])[0], pair.reference(long))  # over a cached prefix


def test_checkpoint_names_are_the_model_names(arch_dir: Path) -> None:
    config = load_model_config(arch_dir)
    model = load_model(config, arch_dir, torch.float32, "cpu")
    assert {name for name, _ in iter_safetensors(arch_dir)} == set(weight_specs(model))
    owned = {id(p) for w in model.linear_weights() for p in w.params}
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tied = config.tie_word_embeddings
    # Every linear layer, and a tied head's embedding, is a LinearWeights block (packing).
    assert len(owned) == len(linear) + tied
    assert (id(model.model.embed_tokens.weight) in owned) == tied


@pytest.mark.anyio
async def test_greedy_tokens_equal_transformers(arch_dir: Path) -> None:
    all_prompts = make_prompts(vocab_size=384)
    expected = []
    for prompt in all_prompts:
        tokens, margin = hf_greedy_with_margin(arch_dir, prompt, MAX_TOKENS)
        assert margin > MIN_MARGIN, "the reference's top-1 is not clear; pick another seed"
        expected.append(tokens)
    # A window over every layer frees blocks as it goes: a smaller cache still preempts.
    num_blocks = 13 if "window" in arch_dir.name else 16
    config = tiny_config(arch_dir, max_num_batched_tokens=16, num_blocks=num_blocks)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(config) as engine:
            results = await generate_all(engine, all_prompts, greedy(MAX_TOKENS))
            stats = engine.stats()
    assert [tokens_of(r) for r in results] == expected
    assert stats.num_preemptions_total > 0, "the cache was meant to be too small"
    assert stats.prefix_cache_hits_total > 0, "the shared prefixes were meant to hit"
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(arch_dir, dtype="bfloat16")) as engine:
            results = await generate_all(engine, all_prompts[:3], greedy(4))
    assert [len(tokens_of(r)) for r in results] == [4, 4, 4]


def test_experts_run_grouped_and_match_a_per_token_reference() -> None:
    torch.manual_seed(0)
    moe = MoEConfig(4, 2, 24, normalize_top_k=False, sparse_layers=(True,))
    block = SparseMoE(16, moe, "silu").requires_grad_(False)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape))
    x = torch.randn(9, 16)
    gemm = Gemm()
    calls = []
    for i, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda _m, args, _o, i=i: calls.append((i, args[0].shape[0])))
    with torch.inference_mode():
        out = block(x, gemm)
        weights, experts = block.route(x, gemm)
    assert [i for i, _ in calls] == sorted({int(e) for e in experts.flatten()})
    assert sum(n for _, n in calls) == 9 * 2  # each row once per chosen expert
    want = torch.zeros_like(x)
    for row in range(9):
        for share, e in zip(weights[row], experts[row], strict=True):
            want[row] += share * block.experts[int(e)](x[row : row + 1], gemm)[0]
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(weights.sum(-1), torch.ones(9))  # Qwen3-MoE's unnormalised kind


def test_unsupported_architecture_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    raw = {**read_config(tiny_llama_dir), "architectures": ["GPT2LMHeadModel"]}
    write_config(tmp_path, raw)
    with pytest.raises(ModelLoadError, match="architecture 'GPT2LMHeadModel' is not supported"):
        load_model_config(tmp_path)


def test_gemma3_config_features(tmp_path: Path) -> None:
    config = load_model_config(make_tiny_model_dir(tmp_path, arch="gemma3"))
    assert config.layer_windows == (6, None, 6)
    assert config.local_rope is not None and config.local_rope.theta != config.rope.theta
    assert config.attention_scale == 24**-0.5
    assert config.final_logit_softcapping == 30.0
    assert config.embed_scale == 64**0.5


def test_longrope_long_factors_match_transformers(tmp_path: Path) -> None:
    """Positions past ``original_max_position_embeddings`` rotate as transformers' long RoPE."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from tgengine.models.rope import RotaryEmbedding

    arch, overrides = ARCHS["phi3-longrope"]
    model_dir = make_tiny_model_dir(tmp_path, arch=arch, **overrides)
    config = load_model_config(model_dir)
    positions = torch.arange(LONGROPE_FROM, LONGROPE_FROM + 20)
    ours = RotaryEmbedding(config.rope, config.head_dim).cos_sin(positions, torch.float32)
    theirs = Phi3RotaryEmbedding(AutoConfig.from_pretrained(model_dir))
    x = torch.zeros(1, 20, 8)
    cos, sin = theirs(x, positions[None])  # max position past the switch: the long factors
    torch.testing.assert_close(ours[0], cos[0])
    torch.testing.assert_close(ours[1], sin[0])
    short = RotaryEmbedding(config.rope, config.head_dim).cos_sin(positions - 20, torch.float32)
    assert short[0].shape == (20, config.head_dim // 2)  # partial: half of each head rotates


def test_fused_and_expert_weights_update_through_their_packed_form(tmp_path: Path) -> None:
    from tgengine.models.weights import copy_weights, pack_weights

    for arch, name in [
        ("phi3", "model.layers.1.self_attn.qkv_proj.weight"),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w3.weight"),
    ]:
        model_dir = make_tiny_model_dir(tmp_path / arch, arch=arch)
        model = load_model(load_model_config(model_dir), model_dir, torch.float32, "cpu")
        model.gemm.prepack = True
        pack_weights(model)
        shape = weight_specs(model)[name][0]
        new = torch.randn(shape)
        copy_weights(model, [(name, new)])
        for weights in model.linear_weights():
            model.gemm.unpack(weights)
        torch.testing.assert_close(dict(model.named_parameters())[name], new, rtol=0, atol=0)
