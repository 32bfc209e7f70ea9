"""Structured outputs on the real default model: its 49k-token vocabulary, its chat template."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tgengine import EngineConfig, SamplingParams, open_engine
from tgengine.cli.default_model import ensure_default_model
from tgengine.tokenization.tokenizer import chat_prompt

from engine_helpers import collect
from structured_helpers import CASES, check_output, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
QUESTIONS = {
    "json": "Describe a person as JSON with a name, an age, tags and a kind.",
    "regex": "Write an email address.",
    "choice": "Is the sky blue? Answer yes, no or maybe.",
    "grammar": "Write a sum of numbers in parentheses.",
}


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return ensure_default_model(progress=False)


async def test_constrained_chat_answers_match(smollm2_dir: Path) -> None:
    config = EngineConfig(model=str(smollm2_dir), num_blocks=128, max_model_len=512)
    results: dict[str, str] = {}
    with anyio.fail_after(300):
        async with open_engine(config) as engine:
            for kind, question in QUESTIONS.items():
                prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": question}])
                params = SamplingParams(
                    max_tokens=120, temperature=0.7, seed=0, structured_outputs=CASES[kind]
                )
                chunks = await collect(engine, prompt, params)
                assert chunks[-1].finish_reason == "stop", (kind, text_of(chunks))
                results[kind] = text_of(chunks)
    for kind, text in results.items():
        check_output(kind, text)
