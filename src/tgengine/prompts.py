"""``encode_prompt``: a prompt as the token ids the engine admits, or an ``InvalidRequestError``."""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequestError


def encode_prompt(
    tokenizer: Any, prompt: str | list[int], vocab_size: int, max_model_len: int
) -> list[int]:
    """Token ids of ``prompt`` (a str, or token ids checked against the vocabulary).

    Raises ``InvalidRequestError`` for an empty prompt, ids outside the vocabulary, or a
    prompt that leaves no room for one generated token.
    """
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
