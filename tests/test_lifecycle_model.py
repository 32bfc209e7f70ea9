"""The lifecycle machine's outcome check on hand-made cases (no engine): the cases it must
accept and those it must reject, each one a hole or a false alarm found once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tgengine import RequestOutput
from tgengine.errors import CacheNotReadyError

from lifecycle_model import CACHE_ERROR, RequestModel, check_outcome
from lifecycle_sampling import LogprobReference, check_sampling

REFERENCE: dict[str, dict[Any, list[int] | None]] = {"A": {0: [182, 7, 9, 11]}}


def cancelled_victim(chunks: list[RequestOutput], engine_reason: str) -> RequestModel:
    """A cache-error victim whose consumer was then cancelled (``cancel_consumer``)."""
    req = RequestModel("m0", 1, prompt=0, max_tokens=4, stop_token=None, weights="A",
                       break_after=None, held=False)  # fmt: skip
    req.may_end("error", CACHE_ERROR, now=False)
    req.may_end("abort")
    req.chunks, req.engine_reason = chunks, engine_reason
    req.cancelled = req.gone_at_once = True
    return req


def test_a_consumer_cancelled_after_its_terminal_chunk_is_an_ordinary_end() -> None:
    """The CI flake of the machine (trio): the request's cache error reached the consumer,
    then the cancel landed at the consumer's next checkpoint, so it saw an end *and* was
    cancelled. The engine did nothing wrong; the check must judge that end as any other."""
    error = str(CacheNotReadyError("m0", "injected fault: cache not ready"))
    chunks = [
        RequestOutput("m0", [182]),
        RequestOutput("m0", [], finish_reason="error", error=error),
    ]
    check_outcome(cancelled_victim(chunks, "error"), REFERENCE, {0: "A"})


@pytest.mark.parametrize(
    "chunks, engine_reason",
    [
        # the end it saw is not the one the engine recorded
        ([RequestOutput("m0", [182]), RequestOutput("m0", [], finish_reason="abort")], "error"),
        # an error that is not the one allowed
        ([RequestOutput("m0", [], finish_reason="error", error="engine died: Boom")], "error"),
        # wrong tokens before the end
        ([RequestOutput("m0", [5]), RequestOutput("m0", [], finish_reason="abort")], "abort"),
        # tokens after a terminal chunk
        ([RequestOutput("m0", [], finish_reason="abort"), RequestOutput("m0", [182])], "abort"),
    ],
)
def test_a_cancelled_consumer_that_saw_its_end_is_still_checked(
    chunks: list[RequestOutput], engine_reason: str
) -> None:
    with pytest.raises(AssertionError):
        check_outcome(cancelled_victim(chunks, engine_reason), REFERENCE, {0: "A"})


def broke_after(chunks: list[RequestOutput]) -> RequestModel:
    """A request admitted under weights "A" whose consumer left after ``chunks``."""
    req = RequestModel("m0", 1, prompt=0, max_tokens=4, stop_token=None, weights="A",
                       break_after=len(chunks), held=False)  # fmt: skip
    req.chunks, req.broke, req.gone_at_once = chunks, True, True
    req.may_end("abort")
    req.engine_reason = "abort"
    return req


def test_a_token_from_new_weights_before_the_consumer_left_is_not_natural() -> None:
    """The CI flake of the machine (asyncio, sliding window): an update to weights "B"
    committed, a step computed the third token with them, and the consumer took it and left
    before the machine marked the live requests. Its chunk's version says which weights."""
    chunks = [RequestOutput("m0", [182]), RequestOutput("m0", [7])]
    chunks.append(RequestOutput("m0", [66], weight_version=1))
    check_outcome(broke_after(chunks), REFERENCE, {0: "A", 1: "B"})


@pytest.mark.parametrize(
    "chunks, weight_sets",
    [
        # the same token under a version whose weights did not change: it must be natural
        (
            [RequestOutput("m0", [182]), RequestOutput("m0", [66], weight_version=1)],
            {0: "A", 1: "A"},
        ),
        # a wrong token before the weights changed
        ([RequestOutput("m0", [5]), RequestOutput("m0", [66], weight_version=1)], {0: "A", 1: "B"}),
    ],
)
def test_tokens_before_a_weight_change_are_still_checked(
    chunks: list[RequestOutput], weight_sets: dict[int, str]
) -> None:
    with pytest.raises(AssertionError):
        check_outcome(broke_after(chunks), REFERENCE, weight_sets)


def logprob_chunks(versions: list[int]) -> list[RequestOutput]:
    """Chunks of tokens 182, 7, 9 with log probabilities: the reference's below for
    version 0, another distribution's for a later one."""
    chunks = []
    for i, (token, version) in enumerate(zip([182, 7, 9], versions, strict=True)):
        value = -0.5 if version == 0 else -2.5
        first = i == 0
        chunks.append(
            RequestOutput(
                "m0",
                [token],
                logprobs=[value],
                top_logprobs=[{token: value, 3: -4.0}],
                weight_version=version,
                prompt_logprobs=[None, -1.0] if first else None,
                prompt_top_logprobs=[None, {5: -1.0}] if first else None,
            )
        )
    return chunks


def logprob_reference() -> dict[str, dict[int, LogprobReference]]:
    rows = torch.full((4, 200), -9.0)
    rows[:, 3] = -4.0
    for i, token in enumerate([182, 7, 9]):
        rows[i, token] = -0.5
    return {"A": {0: LogprobReference([None, -1.0], rows)}}


def test_log_probabilities_from_new_weights_are_not_the_references() -> None:
    """The same race seen by the log probability check (CI, stop 47): the third token's
    came from weights "B", which the reference of "A" does not know."""
    req = broke_after(logprob_chunks([0, 0, 1]))
    req.logprobs = True
    check_sampling(req, [1, 5], "", logprob_reference(), {0: "A", 1: "B"})
    with pytest.raises(AssertionError):  # the same chunks, the weights unchanged: wrong
        check_sampling(req, [1, 5], "", logprob_reference(), {0: "A", 1: "A"})
