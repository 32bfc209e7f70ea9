"""``SamplingParams``: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import InvalidRequestError
from .structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request; validated on construction.

    ``temperature=0`` is greedy, ``top_k=0`` is off, ``seed`` makes a sampled request
    reproducible whatever else is in the batch. ``logprobs=True`` returns the log
    probability of each sampled token under the model's distribution (before
    temperature, top-k and top-p). Invalid values raise ``InvalidRequestError``
    (a ``ValueError``) naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")
