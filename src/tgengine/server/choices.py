"""``Choice``: everything one choice of a response produced, as its chunks arrive."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..outputs import FinishReason, RequestOutput
from .protocol import Usage


@dataclass
class Choice:
    """One choice (one sequence of one prompt); ``echo`` holds the prompt's text if echoed.

    ``prompt_token_ids`` is the prompt; ``prompt_logprobs`` and ``prompt_top_logprobs``
    come with the first chunk that has tokens when the prompt is echoed with logprobs.
    ``sent_tokens`` and ``sent_chars`` count what was already streamed, for offsets.
    ``weight_versions``: ``[first token index, weight version]`` each time the version that
    sampled the tokens changed (one pair unless the request spanned a weight update).
    """

    index: int
    prompt_token_ids: list[int]
    echo: str | None = None
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_chunks: int = 0
    sent_chars: int = 0
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    last_version: int = 0

    @property
    def versions(self) -> list[tuple[int, int]]:
        """``weight_versions``, or the one version a choice without tokens finished at."""
        return self.weight_versions or [(0, self.last_version)]

    @property
    def text(self) -> str:
        return (self.echo or "") + "".join(self.pieces)

    def add(self, out: RequestOutput) -> None:
        self.num_chunks += 1
        if out.text:
            self.pieces.append(out.text)
        versions = self.weight_versions
        if out.token_ids and (not versions or versions[-1][1] != out.weight_version):
            versions.append((len(self.token_ids), out.weight_version))
        self.last_version = out.weight_version
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.top_logprobs += out.top_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_top_logprobs = out.prompt_top_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.error = out.error


def usage(choices: list[Choice]) -> Usage:
    """Prompt tokens once per prompt (choices of one prompt share it), completion summed."""
    prompts: dict[int, int] = {}
    for choice in choices:
        prompts.setdefault(id(choice.prompt_token_ids), len(choice.prompt_token_ids))
    prompt = sum(prompts.values())
    completion = sum(len(choice.token_ids) for choice in choices)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
