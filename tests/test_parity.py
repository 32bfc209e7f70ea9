"""Greedy tokens equal transformers ``generate``, token for token, in every batching regime."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import open_engine

from engine_helpers import (
    TIMEOUT,
    collect,
    generate_all,
    greedy,
    hf_greedy,
    make_prompts,
    tiny_config,
    tokens_of,
)

pytestmark = pytest.mark.anyio
MAX_TOKENS = 12

REGIMES = {
    "batched": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 5},
    "preemption": {"num_blocks": 20},
}


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts(vocab_size=384)
    return prompts, [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]


async def test_one_at_a_time(model_dir: Path) -> None:
    prompts, expected = reference(model_dir)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(model_dir)) as engine:
            for prompt, want in zip(prompts, expected, strict=True):
                assert tokens_of(await collect(engine, prompt, greedy(MAX_TOKENS))) == want


@pytest.mark.parametrize("regime", list(REGIMES))
async def test_all_at_once(model_dir: Path, regime: str) -> None:
    prompts, expected = reference(model_dir)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(model_dir, **REGIMES[regime])) as engine:
            results = await generate_all(engine, prompts, greedy(MAX_TOKENS))
            stats = engine.stats()
    assert [tokens_of(r) for r in results] == expected
    assert all(r[-1].finish_reason == "length" for r in results)
    if regime == "preemption":
        assert stats.num_preemptions_total > 0, "the cache was meant to be too small"
    assert stats.num_free_blocks == stats.num_total_blocks
