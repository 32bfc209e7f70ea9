"""What ``Engine.generate`` checks of a request before admitting it (no engine state)."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from ..sampling import SamplingParams


def encode_prompt(
    tokenizer: Any, prompt: str | list[int], vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt's token ids; ``InvalidRequestError("prompt", ...)`` if unusable."""
    if isinstance(prompt, str):
        token_ids = list(tokenizer.encode(prompt)) if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        token_ids = list(prompt)
    else:
        raise InvalidRequestError("prompt", "must be a str or a list of int token ids")
    if not token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab_size})")
    limit = max_model_len - 1
    if len(token_ids) > limit:
        raise InvalidRequestError(
            "prompt", f"{len(token_ids)} tokens; this model allows at most {limit}"
        )
    return token_ids


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """``logit_bias`` and ``stop_token_ids`` name tokens of the vocabulary."""
    checked = {"logit_bias": params.logit_bias or {}, "stop_token_ids": params.stop_token_ids}
    for name, ids in checked.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                name, f"token id {bad[0]} is out of vocabulary (vocabulary size {vocab_size})"
            )
