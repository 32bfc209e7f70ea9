"""Tensor parallelism at size 2: two gloo ranks on the CPU, each with its shard.

Greedy tokens at size 2 equal transformers' (float32, prompts with a clear top-1 margin) for
every architecture family, on one group of spawned ranks that serves model after model
(``tp_harness``: an engine's worker start per model would cost too much); one rank's cache
error is every rank's; each rank reads only its shard. Then an ``Engine`` on the ``mp``
executor at size 2: tokens, half the weights and KV per rank, a bad weight update refused
by every rank, a good one reaching every shard, sleep and wakeup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tgengine import Engine, InvalidRequestError, ModelLoadError
from tgengine.core.step import SeqStep, StepBatch, StepResult
from tgengine.executor.worker import Execute
from tgengine.models import KVCache, iter_safetensors, load_model, load_model_config
from tgengine.models.weights import resident_bytes
from tgengine.sampling import SamplingParams

from engine_helpers import (
    TIMEOUT,
    generate_all,
    greedy,
    hf_greedy,
    hf_greedy_with_margin,
    make_prompts,
    tiny_config,
    tokens_of,
)
from fault_injection import FaultPlan
from model_factory import make_tiny_model_dir
from process_helpers import child_pids
from tp_harness import RankGroup

WORLD_SIZE = 2
MAX_TOKENS = 6
MIN_MARGIN = 1e-3
BF16_MARGIN = 0.25
ARCHS: dict[str, tuple[str, dict[str, object]]] = {
    # (plain Llama: test_engine_at_size_2_on_mp)
    # tied head, q/k/v bias, a vocabulary padded to split evenly
    "qwen2-odd-vocab": ("qwen2", {"vocab_size": 385}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    "gemma3": ("gemma3", {}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "llama-1kv": ("llama", {"num_key_value_heads": 1}),  # the KV head on both ranks
}


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankGroup]:
    resource_tracker.ensure_running()  # spawn's helper process, which lives on
    before = child_pids()
    group = RankGroup(WORLD_SIZE)
    try:
        yield group
    finally:
        group.close()
    assert child_pids() == before


def prefill_batch(prompts: list[list[int]], max_tokens: int) -> StepBatch:
    """Every prompt as one sequence ``s{i}`` in its own blocks (block size 4), greedy."""
    per_seq = -(-(max(len(p) for p in prompts) + max_tokens) // 4)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return StepBatch(
        [
            SeqStep(f"s{i}", list(p), 0, list(range(i * per_seq, (i + 1) * per_seq)), params)
            for i, p in enumerate(prompts)
        ]
    )


def greedy_tokens(
    execute: Callable[[StepBatch], StepResult], prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy decode of every prompt in one batch, as the engine would step it."""
    seqs = prefill_batch(prompts, max_tokens).seqs
    params = seqs[0].params
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        result = execute(StepBatch(seqs))
        assert not result.errors
        seqs = [
            SeqStep(
                s.seq_id,
                [result.token_ids[s.seq_id]],
                s.start_pos + len(s.token_ids),
                s.block_table,
                params,
            )
            for s in seqs
        ]
        for tokens, s in zip(out, seqs, strict=True):
            tokens.append(s.token_ids[0])
    return out


def group_execute(group: RankGroup) -> Callable[[StepBatch], StepResult]:
    def execute(batch: StepBatch) -> StepResult:
        driver, *others = group.call(Execute(batch))
        assert all(not r.token_ids for r in others), "only rank 0 samples"
        return driver

    return execute


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_tokens_at_size_2_equal_transformers(
    name: str, ranks: RankGroup, tmp_path: Path
) -> None:
    arch, overrides = ARCHS[name]
    model_dir = make_tiny_model_dir(tmp_path, arch=arch, **overrides)
    prompts = make_prompts(vocab_size=384, count=3)
    expected = []
    for prompt in prompts:
        tokens, margin = hf_greedy_with_margin(model_dir, prompt, MAX_TOKENS)
        assert margin > MIN_MARGIN, "the reference's top-1 is not clear; pick another seed"
        expected.append(tokens)
    ranks.load(tiny_config(model_dir))
    try:
        assert greedy_tokens(group_execute(ranks), prompts, MAX_TOKENS) == expected
    finally:
        ranks.unload()


def test_ranks_agree_on_one_ranks_cache_error(ranks: RankGroup, tiny_llama_dir: Path) -> None:
    """Rank 1 alone finds s1's cache not ready: s1 fails on every rank, s0 and s2 go on."""
    prompts = make_prompts(vocab_size=384, count=3)
    faults = FaultPlan(cache_not_ready_at={1: {"s1"}}, ranks=frozenset({1}))
    ranks.load(tiny_config(tiny_llama_dir))
    try:
        results = ranks.call(Execute(prefill_batch(prompts, 1)), faults=faults)
    finally:
        ranks.unload()
    assert [set(r.errors) for r in results] == [{"s1"}, {"s1"}]
    assert "not ready on another rank" in results[0].errors["s1"]
    assert "injected fault" in results[1].errors["s1"]
    first = [hf_greedy(tiny_llama_dir, p, 1)[0] for p in prompts]
    assert results[0].token_ids == {"s0": first[0], "s2": first[2]}


def test_each_rank_reads_only_its_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded in one process as rank 0 and rank 1 of 2 (loading needs no collective)."""
    from tgengine.models.safetensors_reader import StoredTensor
    from tgengine.runtime.parallel import ParallelContext

    model_dir = make_tiny_model_dir(tmp_path, arch="phi3", num_key_value_heads=1)
    config = load_model_config(model_dir)
    full = dict(iter_safetensors(model_dir))
    read = [0]
    read_at = StoredTensor._read_at

    def counted(self: StoredTensor, f: Any, position: int, out: torch.Tensor) -> None:
        read[0] += out.numel() * out.element_size()
        read_at(self, f, position, out)

    monkeypatch.setattr(StoredTensor, "_read_at", counted)
    halves = []
    for r in range(2):
        read[0] = 0
        model = load_model(config, model_dir, torch.float32, "cpu", ParallelContext(r, 2))
        halves.append(dict(model.named_parameters()))
        # Bytes read from disk: exactly what the rank holds (float32 on both sides).
        assert read[0] == sum(p.numel() * 4 for p in halves[-1].values())
    layer = "model.layers.0."
    # Fused q/k/v rows: each rank its 2 of 4 query heads, and the one KV head both.
    q, kv = 2 * 16, 16
    qkv = full[layer + "self_attn.qkv_proj.weight"]
    for r, half in enumerate(halves):
        rows = [qkv[r * q : (r + 1) * q], qkv[4 * 16 : 4 * 16 + kv], qkv[4 * 16 + kv :]]
        assert torch.equal(half[layer + "self_attn.qkv_proj.weight"], torch.cat(rows))
    # Row-parallel: columns; fused gate/up: each rank half of either; vocabulary: rows.
    for name, dim in [
        ("self_attn.o_proj.weight", 1),
        ("mlp.down_proj.weight", 1),
        ("input_layernorm.weight", None),
    ]:
        parts = [half[layer + name] for half in halves]
        expected = full[layer + name]
        assert torch.equal(torch.cat(parts, dim) if dim is not None else parts[1], expected)
    gate, up = full[layer + "mlp.gate_up_proj.weight"].chunk(2)
    for r, half in enumerate(halves):
        mine = torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])
        assert torch.equal(half[layer + "mlp.gate_up_proj.weight"], mine)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([half[name] for half in halves]), full[name])
    # Another dtype than the checkpoint's: the slice is read, then cast.
    rank1 = load_model(config, model_dir, torch.bfloat16, "cpu", ParallelContext(1, 2))
    o_proj = dict(rank1.named_parameters())[layer + "self_attn.o_proj.weight"]
    assert torch.equal(o_proj, full[layer + "self_attn.o_proj.weight"][:, q:].bfloat16())


def test_a_model_that_does_not_split_is_refused(tiny_llama_dir: Path) -> None:
    from tgengine.runtime.parallel import ParallelContext

    config = load_model_config(tiny_llama_dir)  # 4 query heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="tensor-parallel size 3"):
        load_model(config, tiny_llama_dir, torch.float32, "meta", ParallelContext(0, 3))


def test_bfloat16_at_size_2(ranks: RankGroup, tmp_path: Path) -> None:
    """Half-precision all-reduces and products on sharded weights (tokens close to float32's)."""
    model_dir = make_tiny_model_dir(tmp_path, arch="qwen3")
    prompts = make_prompts(vocab_size=384, count=2)
    ranks.load(tiny_config(model_dir, dtype="bfloat16"))
    try:
        tokens = greedy_tokens(group_execute(ranks), prompts, MAX_TOKENS)
    finally:
        ranks.unload()
    # The first token wherever float32's top-1 leads by more than bf16's rounding.
    clear = 0
    for prompt, got in zip(prompts, tokens, strict=True):
        (first,), margin = hf_greedy_with_margin(model_dir, prompt, 1)
        if margin > BF16_MARGIN:
            assert got[0] == first
            clear += 1
    assert clear, "no prompt has a clear first token; pick others"


@pytest.mark.anyio
async def test_engine_at_size_2_on_mp(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """One engine on two ``mp`` ranks: tokens, half the memory per rank, weight updates
    (a shard-shaped tensor refused by every rank), sleep and wakeup at both levels."""
    before = child_pids()
    new_dir = make_tiny_model_dir(tmp_path, arch="llama", seed=1)
    prompts = make_prompts(vocab_size=384, count=4)
    old, new = [], []
    for prompt in prompts:
        for model_dir, expected in ((tiny_llama_dir, old), (new_dir, new)):
            tokens, margin = hf_greedy_with_margin(model_dir, prompt, MAX_TOKENS)
            assert margin > MIN_MARGIN
            expected.append(tokens)
    assert old != new
    share = half_share(tiny_llama_dir)
    named = list(iter_safetensors(new_dir))
    # One rank's rows of q_proj, not the full tensor: every rank refuses it.
    bad = [(n, t[: t.shape[0] // 2] if n.endswith("q_proj.weight") else t) for n, t in named]
    config = tiny_config(
        tiny_llama_dir,
        executor="mp",
        tensor_parallel_size=2,
        num_blocks=12,
        max_num_batched_tokens=16,
    )
    engine = Engine(config)
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            results = await generate_all(engine, prompts, greedy(MAX_TOKENS))
            assert [tokens_of(r) for r in results] == old
            assert engine.stats().num_preemptions_total > 0, "meant to run out of blocks"
            stats = engine.memory_stats()
            assert sorted(stats) == ["rank0:cpu", "rank1:cpu"]
            weights, kv = share(config.num_blocks or 0)
            for mine in stats.values():
                assert abs(mine.weights_bytes - weights) <= 0.01 * weights
                assert mine.kv_cache_bytes == kv

            with pytest.raises(InvalidRequestError, match="q_proj"):
                await engine.update_weights(bad)
            assert engine.weight_version == 0
            results = await generate_all(engine, prompts, greedy(MAX_TOKENS))
            assert [tokens_of(r) for r in results] == old
            await engine.update_weights(named)
            assert engine.weight_version == 1
            results = await generate_all(engine, prompts, greedy(MAX_TOKENS))
            assert [tokens_of(r) for r in results] == new

            for level in (1, 2):
                await engine.sleep(level)
                for mine in engine.memory_stats().values():
                    assert (mine.weights_bytes, mine.kv_cache_bytes) == (0, 0)
                await engine.wakeup()
                results = await generate_all(engine, prompts[:2], greedy(MAX_TOKENS))
                # Level 2 reloads from disk: the checkpoint's weights, not the update's.
                assert [tokens_of(r) for r in results] == (new if level == 1 else old)[:2]
            tg.cancel_scope.cancel()
    assert child_pids() == before


def half_share(model_dir: Path) -> Callable[[int], tuple[int, int]]:
    """What one of two ranks holds: ``(weight bytes, KV bytes for num_blocks)``, float32.

    Every weight splits in two but the norms, which each rank holds whole.
    """
    config = load_model_config(model_dir)
    full = load_model(config, model_dir, torch.float32, "cpu")
    total = resident_bytes(full)
    norms = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    per_block = KVCache.bytes_per_block(config, 4, torch.float32)
    return lambda num_blocks: ((total - norms) // 2 + norms, per_block * num_blocks // 2)
