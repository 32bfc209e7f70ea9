from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tgengine import kernels
from tgengine.sample.sampler import Sampler, SamplingRow
from tgengine.sampling import SamplingParams


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


def _seeded(seed: int, **kwargs: Any) -> SamplingRow:
    params = SamplingParams(seed=seed, **kwargs)
    return SamplingRow(params, torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_in_a_mixed_batch() -> None:
    logits = _logits(6, 50)
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rows = [greedy, SamplingRow(SamplingParams()), greedy, _seeded(3), greedy, greedy]
    result = Sampler(seed=0)(logits, rows)
    argmax = logits.argmax(dim=-1).tolist()
    assert [result.token_ids[i] for i in (0, 2, 4, 5)] == [argmax[i] for i in (0, 2, 4, 5)]
    assert result.logprobs is None


@pytest.mark.parametrize("nan", [False, True])
def test_all_greedy_fast_path(nan: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(4, 50)
    if nan:  # torch's argmax picks a NaN; the compiled one refuses it, torch's path runs
        logits[2, 7] = float("nan")
    calls: list[int] = []
    argmax_rows = kernels.argmax_rows
    monkeypatch.setattr(kernels, "argmax_rows", lambda x: calls.append(1) or argmax_rows(x))
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 4
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    assert calls == [1], "greedy rows go through kernels.argmax_rows"


def test_top_k_one_is_greedy_even_at_temperature_one() -> None:
    logits = _logits(8, 100, scale=0.1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=1))] * 4 + [
        _seeded(i, top_k=1) for i in range(4)
    ]
    sampler = Sampler(seed=0)
    for _ in range(5):
        assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def _run_seeded(seed: int, position: int, others: list[SamplingRow], steps: int) -> list[int]:
    """Tokens of one seeded row over ``steps`` steps, placed at ``position`` among others."""
    sampler = Sampler(seed=position + 100)
    row = _seeded(seed, temperature=0.8, top_p=0.9)
    tokens = []
    for step in range(steps):
        batch = [*others[:position], row, *others[position:]]
        logits = _logits(len(batch), 300, seed=1000 + step, scale=1.0)
        # The seeded row sees the same logits whatever the batch around it.
        logits[position] = _logits(1, 300, seed=step, scale=1.0)[0]
        tokens.append(sampler(logits, batch).token_ids[position])
    return tokens


def test_seed_reproduces_across_batch_compositions_and_positions() -> None:
    alone = _run_seeded(seed=7, position=0, others=[], steps=20)
    others = [
        SamplingRow(SamplingParams()),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=True)),
        _seeded(8, top_k=5),
        SamplingRow(SamplingParams(top_k=3, top_p=0.5, temperature=2.0)),
        _seeded(7),
    ]
    for position in (0, 2, 5):
        assert _run_seeded(seed=7, position=position, others=others, steps=20) == alone
    assert _run_seeded(seed=7, position=1, others=others[:1], steps=20) == alone


def test_different_seeds_differ_on_a_flat_distribution() -> None:
    logits = torch.zeros(2, 1000)
    sampler = Sampler(seed=0)
    rows = [_seeded(1), _seeded(2)]
    draws = [sampler(logits, rows).token_ids for _ in range(10)]
    assert [a for a, _ in draws] != [b for _, b in draws]


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(4, 1000)
    rows = [SamplingRow(SamplingParams())] * 4
    first, second, other = Sampler(seed=5), Sampler(seed=5), Sampler(seed=6)
    a = [first(logits, rows).token_ids for _ in range(3)]
    assert a == [second(logits, rows).token_ids for _ in range(3)]
    assert a != [other(logits, rows).token_ids for _ in range(3)]


def test_sampled_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_rows = 20_000
    logits = probs.log().expand(num_rows, -1).contiguous()
    result = Sampler(seed=0)(logits, [SamplingRow(SamplingParams())] * num_rows)
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=4).float() / num_rows
    assert torch.allclose(counts, probs, atol=0.015)


def test_temperature_sharpens_and_top_p_renormalises() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(10_000, -1).contiguous()
    hot = Sampler(seed=0)(logits, [SamplingRow(SamplingParams(temperature=0.5))] * 10_000)
    counts = torch.bincount(torch.tensor(hot.token_ids), minlength=4).float() / 10_000
    assert torch.allclose(counts, torch.softmax(logits[0] / 0.5, dim=-1), atol=0.02)
    nucleus = SamplingRow(SamplingParams(top_p=0.8))  # keeps tokens 0 and 1 (0.64 + 0.24)
    picked = Sampler(seed=0)(logits, [nucleus] * 10_000).token_ids
    counts = torch.bincount(torch.tensor(picked), minlength=4).float() / 10_000
    expected = torch.softmax(logits[0, :2], dim=-1)
    assert counts[2:].sum() == 0
    assert torch.allclose(counts[:2], expected, atol=0.02)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    vocab_size=st.integers(1, 64),
    scale=st.sampled_from([0.01, 1.0, 5.0, 30.0]),
    params=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.05, 0.7, 1.0, 2.5]),
            st.integers(0, 70),
            st.sampled_from([0.01, 0.3, 0.75, 0.95, 1.0]),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_top_k_and_top_p_never_pick_a_masked_token(
    seed: int, vocab_size: int, scale: float, params: list[tuple[float, int, float, bool]]
) -> None:
    logits = _logits(len(params), vocab_size, seed=seed, scale=scale)
    rows = [
        SamplingRow(
            SamplingParams(temperature=t, top_k=k, top_p=p, seed=seed if seeded else None),
            torch.Generator().manual_seed(seed) if seeded else None,
        )
        for t, k, p, seeded in params
    ]
    result = Sampler(seed=seed)(logits, rows)
    for row, token, (temperature, top_k, top_p, _) in zip(
        logits, result.token_ids, params, strict=True
    ):
        assert 0 <= token < vocab_size
        if temperature == 0 or top_k == 1:
            assert row[token] == row.max()
            continue
        scaled = row.double() / temperature
        ranked = scaled.sort(descending=True).values
        k = top_k or vocab_size
        assert scaled[token] >= ranked[min(k, vocab_size) - 1]  # inside the top-k
        kept = ranked[:k]
        probs = torch.softmax(kept, dim=0)
        mass_above = probs[kept > scaled[token]].sum().item()
        assert mass_above < top_p + 1e-4  # inside the nucleus


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_picked_token() -> None:
    logits = _logits(5, 40)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(temperature=0.5, top_k=3, logprobs=True)),
        _seeded(1, top_p=0.5),
        SamplingRow(SamplingParams(temperature=2.0)),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=True)),
    ]
    result = Sampler(seed=0)(logits, rows)
    assert result.logprobs is not None and len(result.logprobs.chosen) == 5
    expected = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(result.token_ids):
        assert result.logprobs.chosen[i] == pytest.approx(expected[i, token].item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [1e-3, 1e-6, 1e-30, 1e-45])
def test_tiny_temperature_is_argmax(temperature: float) -> None:
    logits = _logits(8, 500)
    logits[:, 0] = float("-inf")  # masked vocabulary entries must stay harmless
    rows = [SamplingRow(SamplingParams(temperature=temperature))] * 4 + [
        _seeded(i, temperature=temperature, top_p=0.9, top_k=10) for i in range(4)
    ]
    for _ in range(3):
        result = Sampler(seed=0)(logits, rows)
        assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_all_but_one_token_masked() -> None:
    logits = torch.full((3, 20), float("-inf"))
    logits[:, 7] = 0.0
    rows = [SamplingRow(SamplingParams()), _seeded(0, top_p=0.1), _seeded(1, top_k=5)]
    for _ in range(20):
        assert Sampler(seed=0)(logits, rows).token_ids == [7, 7, 7]


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler(seed=0)(torch.zeros(2, 5), [SamplingRow(SamplingParams())])
