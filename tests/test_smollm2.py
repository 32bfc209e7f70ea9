"""Greedy parity with transformers on the real default model, SmolLM2-135M-Instruct (float32)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import EngineConfig, open_engine
from tgengine.cli.default_model import ensure_default_model

from engine_helpers import generate_all, greedy, hf_greedy, tokens_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three primary colors:",
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return ensure_default_model(progress=False)


async def test_greedy_parity_with_transformers(smollm2_dir: Path) -> None:
    config = EngineConfig(
        model=str(smollm2_dir), dtype="float32", block_size=16, num_blocks=64, max_model_len=256
    )
    with anyio.fail_after(300):
        async with open_engine(config) as engine:
            prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
            results = await generate_all(engine, prompts, greedy(32))
    for prompt, chunks in zip(prompts, results, strict=True):
        assert tokens_of(chunks) == hf_greedy(smollm2_dir, prompt, 32)
