"""The default CPU thread count is measured: the fastest count here, once per process."""

from __future__ import annotations

import pytest
import torch

from tgengine.agent import cpu_threads


def test_fastest_count_is_measured_among_the_cores() -> None:
    before = torch.get_num_threads()
    try:
        best, rates = cpu_threads.fastest_thread_count(torch.float32, 0.01)
        cores = min(cpu_threads.available_cores(), 8)
        assert set(rates) == {str(n) for n in range(1, cores + 1)}
        assert all(rate > 0 for rate in rates.values())
        assert rates[str(best)] == max(rates.values())
        assert torch.get_num_threads() == best
    finally:
        torch.set_num_threads(before)


def test_one_core_needs_no_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    monkeypatch.setattr(cpu_threads, "fastest_thread_count", pytest.fail)
    cpu_threads.default_thread_count.cache_clear()
    try:
        assert cpu_threads.default_thread_count(torch.bfloat16) == 1
    finally:
        cpu_threads.default_thread_count.cache_clear()


def test_one_stalled_round_does_not_decide_the_count() -> None:
    # Two threads twice as fast in four rounds of five, one round stalled (a neighbour, the
    # hypervisor): the median keeps two; the worst round would have picked one.
    rounds = {"1": [100.0, 101.0, 99.0, 100.0, 100.0], "2": [190.0, 40.0, 200.0, 195.0, 188.0]}
    best, rates = cpu_threads.pick_count(rounds)
    assert best == 2 and rates == {"1": 100.0, "2": 190.0}
    assert cpu_threads.pick_count({"1": [100.0] * 5, "2": [90.0] * 5})[0] == 1


def test_a_close_call_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two threads measured as one through the first five rounds (the second core busy
    # elsewhere for a while), then at their speed: all ten rounds pick two.
    assert cpu_threads.is_close_call({"1": 186.0, "2": 185.0})
    assert not cpu_threads.is_close_call({"1": 100.0, "2": 170.0})
    assert not cpu_threads.is_close_call({"1": 100.0})
    seen: list[int] = []

    def rounds_so_far(rounds: dict[str, list[float]]) -> tuple[int, dict[str, float]]:
        seen.append(len(rounds["1"]))
        if len(rounds["1"]) == 5:  # the first five: a tie
            rounds = {"1": [186.0] * 5, "2": [185.0] * 5}
        else:
            rounds = {"1": [186.0] * 5 + [180.0] * 5, "2": [185.0] * 5 + [290.0] * 5}
        return pick(rounds)

    pick = cpu_threads.pick_count
    monkeypatch.setattr(cpu_threads, "pick_count", rounds_so_far)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        best, _ = cpu_threads.fastest_thread_count(torch.float32, 0.001)
    finally:
        torch.set_num_threads(before)
    assert seen == [5, 10] and best == 2
