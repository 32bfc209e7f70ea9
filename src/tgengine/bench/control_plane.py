"""The control plane's cost per step: the ``mp`` executor at size 1 against ``uni``.

With ``--executor mp --tensor-parallel-size 1`` a bench runs tgengine twice on the same
workload in the same run: in this process (``uni``) and with one worker process (``mp``).
Two figures per step: the difference of the measured step times, and, measured inside
the ``mp`` run, the executor's round trip minus the worker's own time (pickling, the
socket, waking each side: what the control plane adds, without the run-to-run noise),
its median over the steps (a busy machine makes a long tail of waits for a core).
The issue's budget is ``max(1 ms, 5 % of a step)``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from .common import BenchSetup

BUDGET_S = 1e-3
BUDGET_FRACTION = 0.05


def wants_comparison(setup: BenchSetup) -> bool:
    return setup.executor_kind == "mp" and setup.tensor_parallel_size == 1


def uni_setup(setup: BenchSetup) -> BenchSetup:
    return dataclasses.replace(setup, executor="uni")


def executor_timings(engine: Engine) -> dict[str, float] | None:
    """The ``mp`` executor's own step timings (None for another executor)."""
    timings = getattr(engine._executor, "timings", None)  # bench instrumentation
    if timings is None or not timings.num_steps:
        return None
    return {
        "num_steps": timings.num_steps,
        "round_trip_s": timings.round_trip_s,
        "worker_s": timings.worker_s,
        "overhead_per_step_s": timings.overhead_per_step_s,
        "median_overhead_s": timings.median_overhead_s,
    }


def compare(
    mp_step_s: float, uni_step_s: float, timings: dict[str, float] | None, what: str
) -> dict[str, Any]:
    """The per-step figures of one comparison (``what``: the steps compared)."""
    budget = max(BUDGET_S, BUDGET_FRACTION * uni_step_s)
    direct = timings["median_overhead_s"] if timings else None
    mean = timings["overhead_per_step_s"] if timings else None
    return {
        "steps": what,
        "uni_step_ms": 1e3 * uni_step_s,
        "mp_step_ms": 1e3 * mp_step_s,
        "difference_ms": 1e3 * (mp_step_s - uni_step_s),
        "round_trip_minus_worker_ms": None if direct is None else 1e3 * direct,
        "round_trip_minus_worker_mean_ms": None if mean is None else 1e3 * mean,
        "budget_ms": 1e3 * budget,
        "within_budget": direct is not None and direct <= budget,
    }


def render(result: dict[str, Any]) -> list[str]:
    c = result.get("control_plane")
    if not c:
        return []
    direct, mean = c["round_trip_minus_worker_ms"], c.get("round_trip_minus_worker_mean_ms")
    direct_text = "n/a" if direct is None else f"median {direct:.3f} ms (mean {mean:.3f} ms)"
    verdict = "within" if c["within_budget"] else "OVER"
    return [
        "",
        f"control plane per step ({c['steps']}): uni {c['uni_step_ms']:.2f} ms, "
        f"mp {c['mp_step_ms']:.2f} ms (difference {c['difference_ms']:+.2f} ms); "
        f"mp round trip minus worker {direct_text}: {verdict} the budget of "
        f"{c['budget_ms']:.2f} ms (max(1 ms, 5% of a step))",
    ]
