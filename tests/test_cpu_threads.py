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


def test_one_stalled_round_does_not_decide_a_pass() -> None:
    # Two threads twice as fast in four rounds of five, one round stalled (a neighbour, the
    # hypervisor): the median keeps two; the worst round would have picked one.
    rounds = {"1": [100.0, 101.0, 99.0, 100.0, 100.0], "2": [190.0, 40.0, 200.0, 195.0, 188.0]}
    assert cpu_threads.median_rates(rounds) == {"1": 100.0, "2": 190.0}
    assert cpu_threads.pick_count([{"1": 100.0, "2": 190.0}]) == (2, {"1": 100.0, "2": 190.0})
    assert cpu_threads.pick_count([{"1": 100.0, "2": 90.0}])[0] == 1


def test_which_calls_are_measured_again() -> None:
    assert cpu_threads.needs_second_pass({"1": 186.0, "2": 185.0})  # close
    assert cpu_threads.needs_second_pass({"1": 186.0, "2": 100.0})  # fewer threads than cores
    assert cpu_threads.needs_second_pass({"1": 100.0, "2": 300.0, "3": 180.0, "4": 120.0})
    assert not cpu_threads.needs_second_pass({"1": 100.0, "2": 170.0})
    assert not cpu_threads.needs_second_pass({"1": 100.0})
    assert cpu_threads.is_close_call({"1": 186.0, "2": 185.0})
    assert not cpu_threads.is_close_call({"1": 100.0, "2": 170.0})


def _probe_with_passes(
    monkeypatch: pytest.MonkeyPatch, passes: list[dict[str, float]]
) -> tuple[int, dict[str, float], int]:
    """fastest_thread_count on 2 cores whose passes measure ``passes`` in turn."""
    taken: list[dict[str, float]] = []

    def measure_pass(*args: object) -> dict[str, float]:
        taken.append(passes[len(taken)])
        return taken[-1]

    monkeypatch.setattr(cpu_threads, "measure_pass", measure_pass)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        best, rates = cpu_threads.fastest_thread_count(torch.float32, 0.001)
        assert torch.get_num_threads() == best
    finally:
        torch.set_num_threads(before)
    return best, rates, len(taken)


def test_a_stall_over_a_whole_pass_does_not_decide_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The second vCPU busy elsewhere through the first pass: two threads measured slower than
    # one. The second pass sees them at their speed, and each count keeps its better pass.
    stalled, clear = {"1": 186.0, "2": 80.0}, {"1": 180.0, "2": 290.0}
    assert _probe_with_passes(monkeypatch, [stalled, clear]) == (
        2,
        {"1": 186.0, "2": 290.0},
        2,
    )
    # A close call is looked at again too.
    assert _probe_with_passes(monkeypatch, [{"1": 186.0, "2": 185.0}, clear])[::2] == (2, 2)


def test_one_thread_wins_where_it_is_faster_in_both_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A quota-limited VM: a second thread only fights a neighbour, in every pass.
    slow_two = [{"1": 180.0, "2": 120.0}, {"1": 175.0, "2": 130.0}]
    assert _probe_with_passes(monkeypatch, slow_two)[::2] == (1, 2)


def test_a_clear_call_for_every_core_is_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _probe_with_passes(monkeypatch, [{"1": 180.0, "2": 290.0}])[::2] == (2, 1)
