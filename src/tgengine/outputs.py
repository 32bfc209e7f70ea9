"""What a request's stream yields: one ``RequestOutput`` per chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class RequestOutput:
    """One streamed chunk of a request.

    ``token_ids`` and ``text`` hold only what is new in this chunk. The last chunk of
    every admitted request has a ``finish_reason``; no chunk follows it. With
    ``SamplingParams(n > 1)`` the chunks of the ``n`` sequences interleave in one stream:
    ``index`` says which one a chunk belongs to, each sequence ends with its own chunk
    with a ``finish_reason``, and the stream ends after all of them.

    ``logprobs`` holds the log probability of each new token and ``top_logprobs`` its
    ``SamplingParams.logprobs`` most likely alternatives (``{token id: logprob}``, most
    likely first); both are None unless asked for. ``prompt_logprobs`` and
    ``prompt_top_logprobs`` (one entry per prompt token, the first None) come once, with
    the first chunk that has tokens, when ``SamplingParams.prompt_logprobs`` is set.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    weight_version: int = 0
    num_prompt_tokens: int = 0
    index: int = 0
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
