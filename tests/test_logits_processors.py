"""The batched logits processors and top log probabilities, on hand-made logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tgengine.errors import InvalidRequestError
from tgengine.sample.logits_processors import (
    LogitBias,
    MinTokens,
    Penalties,
    SamplingRow,
    apply_processors,
    default_processors,
)
from tgengine.sample.sampler import Sampler
from tgengine.sampling import SamplingParams

VOCAB = 8


def _row(output: list[int], prompt: tuple[int, ...] = (), **params: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), None, "s", prompt, output)


def test_frequency_and_presence_follow_openai_definitions() -> None:
    logits = torch.zeros(1, VOCAB)
    row = _row([1, 1, 2], prompt=(3,), frequency_penalty=0.5, presence_penalty=0.25)
    out = Penalties().apply(logits, [row])[0]
    # count 2 -> 2 * 0.5 + 0.25; count 1 -> 0.5 + 0.25; the prompt does not count
    assert out.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 0.0, 0.0, 0.0]])
    row = _row([0, 1], prompt=(4,), repetition_penalty=2.0)
    out = Penalties().apply(logits.clone(), [row])[0]
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0, 0.5, 0.0, 0.0, 0.0]


def test_logit_bias_adds_and_min_tokens_masks_stops_until_reached() -> None:
    logits = torch.zeros(3, VOCAB)
    rows = [
        _row([], logit_bias={2: 5.0, 7: -1.5}),
        _row([5], min_tokens=2, stop_token_ids=(6,)),
        _row([5, 5], min_tokens=2, stop_token_ids=(6,)),  # reached: nothing masked
    ]
    out = apply_processors(logits, rows, default_processors(frozenset({0})))
    assert out[0].tolist() == [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, -1.5]
    assert out[1, 0] == out[1, 6] == float("-inf") and out[1, 1:6].eq(0).all()
    assert out[2].eq(0).all()


def test_processors_leave_rows_at_their_defaults_untouched() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [_row([1, 2]), _row([3], presence_penalty=1.0), _row([1]), _row([], logit_bias={1: 1})]
    out = apply_processors(logits.clone(), rows, default_processors(frozenset({0})))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 3] == logits[1, 3] - 1 and out[3, 1] == logits[3, 1] + 1
    for processor in (MinTokens(frozenset()), LogitBias(), Penalties()):
        assert not processor.is_active(_row([1, 2]))


def test_greedy_follows_the_processed_logits_and_logprobs_the_raw_ones() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    sampler = Sampler(seed=0, processors=default_processors(frozenset()))
    row = _row([], temperature=0.0, logit_bias={5: 10.0}, logprobs=3)
    result = sampler(logits.clone(), [row])
    assert result.token_ids == [5]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert result.logprobs is not None
    assert result.logprobs.chosen[0] == pytest.approx(raw[5].item())
    assert list(result.logprobs.top(0)) == [0, 1, 2]
    assert list(result.logprobs.top(0).values()) == pytest.approx(raw[:3].tolist())


def test_top_logprobs_per_row_count() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [_row([], logprobs=0), _row([]), _row([], logprobs=5)]
    result = Sampler(seed=0)(logits, rows)
    assert result.logprobs is not None
    assert [len(result.logprobs.top(i)) for i in range(3)] == [0, 0, 5]
    top = list(result.logprobs.top(2).values())
    assert top == sorted(top, reverse=True)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", {"n": 0}),
        ("logprobs", {"logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": float("nan")}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("logit_bias", {"logit_bias": {1: 101.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("min_tokens", {"min_tokens": 17}),
    ],
)
def test_new_sampling_params_name_the_bad_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_logprobs_true_and_false_still_work() -> None:
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None
