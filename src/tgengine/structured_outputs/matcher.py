"""``GrammarMatcher``: one sequence's position in its grammar, kept in step with its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import llguidance


class GrammarRejectedError(ValueError):
    """A generated token does not fit the grammar (only if the mask was bypassed)."""

    def __init__(self, token_id: int, reason: str) -> None:
        super().__init__(f"structured output: token {token_id} rejected by the grammar: {reason}")


class GrammarMatcher:
    """The matcher of one sequence: the grammar state after its generated tokens.

    The state is a function of the tokens alone. ``sync`` brings it up to date with the
    sequence's completion tokens: tokens it has not seen are replayed, and if the sequence
    holds fewer tokens than were consumed, it starts over and replays them all. So a
    preempted, recomputed or otherwise restarted sequence always gets the right mask.
    """

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.num_consumed = 0

    def sync(self, completion_token_ids: Sequence[int]) -> None:
        """Consume the tokens of ``completion_token_ids`` this matcher has not seen yet."""
        if len(completion_token_ids) < self.num_consumed:
            self._matcher.reset()
            self.num_consumed = 0
        for token in completion_token_ids[self.num_consumed :]:
            if not self._matcher.consume_token(token):
                raise GrammarRejectedError(token, self._error())
            self.num_consumed += 1

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit ``t`` = token ``t``)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if self._matcher.is_error():
            raise GrammarRejectedError(-1, self._error())

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and its end (EOS) was consumed."""
        return bool(self._matcher.is_stopped())

    def _error(self) -> str:
        return self._matcher.get_error().split("\n<state>")[0].strip()
