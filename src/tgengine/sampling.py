"""``SamplingParams``: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequestError
from .structured_outputs import StructuredOutputsParams

MAX_N = 64  # sequences per request
MAX_LOGPROBS = 20  # alternatives per position, as OpenAI and vLLM's default


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request; validated on construction (as in vLLM).

    ``temperature=0`` is greedy, ``top_k=0`` is off, ``seed`` makes a sampled request
    reproducible whatever else is in the batch. ``n`` sequences are sampled from one prompt
    (computed once); sequence ``i`` of a seeded request uses ``seed + i``.

    ``logprobs=None`` returns no log probabilities; ``logprobs=k`` (0..20) returns the log
    probability of each sampled token and of the ``k`` most likely tokens at its position
    (``True`` means 0, ``False`` means None). ``prompt_logprobs=k`` does the same for the
    prompt tokens. Both are taken from the model's raw distribution (before penalties,
    biases, temperature, top-k and top-p), as vLLM does by default.

    Penalties follow OpenAI's definitions over the tokens generated so far:
    ``presence_penalty`` is subtracted once from every token that occurred,
    ``frequency_penalty`` once per occurrence. ``repetition_penalty`` (vLLM's, over prompt
    and output) divides positive logits and multiplies negative ones of every token seen.
    ``logit_bias`` maps token ids to values added to their logits. ``min_tokens`` masks EOS
    and ``stop_token_ids`` until that many tokens were generated.

    Invalid values raise ``InvalidRequestError`` (a ``ValueError``) naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        so = StructuredOutputsParams.coerce(self.structured_outputs)
        object.__setattr__(self, "structured_outputs", so)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:  # torch.Generator takes a signed 64-bit seed
                raise InvalidRequestError("seed", f"must be < 2**63, got {self.seed}")
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        object.__setattr__(self, "logprobs", _logprobs("logprobs", self.logprobs))
        object.__setattr__(
            self, "prompt_logprobs", _logprobs("prompt_logprobs", self.prompt_logprobs)
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise InvalidRequestError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}"
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties, ``min_tokens``)."""
        return self.has_penalties or self.min_tokens > 0


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(name, f"must be <= {maximum}, got {value}")


def _logprobs(name: str, value: Any) -> int | None:
    if value is None or value is False:
        return None
    if value is True:
        return 0
    _check_int(name, value, minimum=0, maximum=MAX_LOGPROBS)
    return int(value)


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError("logit_bias", f"must map token ids to numbers, got {value!r}")
    for token, bias in value.items():
        _check_int("logit_bias", token, minimum=0)
        if not _is_real(bias) or not -100 <= bias <= 100:
            raise InvalidRequestError("logit_bias", f"bias of {token} must be in [-100, 100]")
    return {int(k): float(v) for k, v in value.items()} or None
