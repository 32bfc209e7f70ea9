"""The fake ``vllm.inputs``: a token-id prompt is a dict, as in vLLM."""

from __future__ import annotations

from typing import Any


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, Any]:
    assert all(isinstance(t, int) for t in prompt_token_ids)
    return {"prompt_token_ids": prompt_token_ids}
