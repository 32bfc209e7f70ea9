"""``Admission``: what the parent checks before a request crosses to the engine process.

The same checks as ``Engine`` makes at admission — the prompt (tokenized here, so the
engine process receives token ids) and a structured-outputs constraint (compiled here
too, cached) — so that ``generate()`` raises ``InvalidRequestError`` at once, as in-process.
"""

from __future__ import annotations

from typing import Any

from ..engine.admission import check_token_ids, encode_prompt
from ..sampling import SamplingParams
from ..structured_outputs.grammars import Grammars


class Admission:
    """Prompt and constraint checks for one engine's model and tokenizer."""

    def __init__(self, tokenizer: Any, model_config: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.grammars = Grammars(tokenizer, model_config.vocab_size, model_config.eos_token_ids)

    def token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids; ``InvalidRequestError`` if the engine would refuse it."""
        vocab_size = self.model_config.vocab_size
        token_ids = encode_prompt(self.tokenizer, prompt, vocab_size, self.max_model_len)
        check_token_ids(params, vocab_size)
        self.grammars.matcher(params.structured_outputs)
        return token_ids

    def compile(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint into the cache (call it in a worker thread)."""
        self.grammars.matcher(params.structured_outputs)
