"""Sliding windows: where every layer is local, blocks behind the window go back to the pool.

A long generation then holds about ``window / block_size + 1`` blocks however far it goes;
where some layer attends to every key (Gemma 3's interleaving) nothing is released. Greedy
tokens equal transformers' in float32 either way.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import EngineConfig, open_engine
from tgengine.engine.request_stats import RequestStats, StepStats

from engine_helpers import (
    TIMEOUT,
    generate_all,
    greedy,
    hf_greedy_with_margin,
    make_prompts,
    tiny_config,
    tokens_of,
)
from model_factory import make_tiny_model_dir

WINDOW = 8
BLOCK_SIZE = 4
MAX_TOKENS = 40  # five windows past the prompt
MIN_MARGIN = 1e-3
# name: (factory arch, config overrides, whether every layer is local)
MODELS: dict[str, tuple[str, dict[str, object], bool]] = {
    "mistral-all-local": ("mistral", {"sliding_window": WINDOW}, True),
    "gemma3-all-local": (
        "gemma3",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention"] * 3},
        True,
    ),
    "gemma3-interleaved": ("gemma3", {"sliding_window": WINDOW}, False),
}


class BlockUsage:
    """An engine observer: the most KV blocks in use after any step."""

    def __init__(self, config: EngineConfig) -> None:
        self.num_total = config.num_blocks
        self.read_free = lambda: self.num_total
        self.peak = 0

    def step_finished(self, stats: StepStats) -> None:
        self.peak = max(self.peak, self.num_total - self.read_free())

    def request_finished(self, stats: RequestStats) -> None:
        pass


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides, _ = MODELS[model]
    return make_tiny_model_dir(tmp_path_factory.mktemp(model), arch=arch, **overrides)


@pytest.mark.anyio
async def test_long_generation_holds_only_the_window(model: str, model_dir: Path) -> None:
    all_local = MODELS[model][2]
    prompt = make_prompts(vocab_size=384)[3]  # 13 tokens
    expected, margin = hf_greedy_with_margin(model_dir, prompt, MAX_TOKENS)
    assert margin > MIN_MARGIN, "the reference's top-1 is not clear; pick another prompt"
    config = tiny_config(model_dir, block_size=BLOCK_SIZE, num_blocks=32)
    usage = BlockUsage(config)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(config) as engine:
            usage.read_free = lambda: engine.stats().num_free_blocks
            engine.observers.append(usage)
            [result] = await generate_all(engine, [prompt], greedy(MAX_TOKENS))
            assert engine.stats().num_free_blocks == config.num_blocks
    assert tokens_of(result) == expected
    if all_local:
        assert usage.peak <= -(-WINDOW // BLOCK_SIZE) + 1
    else:  # the last step holds a block for every token but the last sampled one
        assert usage.peak == -(-(len(prompt) + MAX_TOKENS - 1) // BLOCK_SIZE)
