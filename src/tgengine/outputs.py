"""What a request's stream yields: one ``RequestOutput`` per chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class RequestOutput:
    """One streamed chunk of a request.

    ``token_ids`` and ``text`` hold only what is new in this chunk. The last chunk of
    every admitted request has a ``finish_reason``; no chunk follows it.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    weight_version: int = 0
    num_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
