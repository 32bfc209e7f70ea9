"""How many CPU threads torch should use here: the count that runs a decode step fastest.

``fastest_thread_count`` times 1..cores (at most 8) threads on what a decode step does — a
small-batch GEMM pair through the engine's own GEMM routing (packed, as by default), with a
float32 norm and an activation in between — in a pass of five interleaved rounds, and keeps
each count's median round. A call that needs confirming (a close one, or fewer threads than
candidates) gets a second pass, and each count keeps its better pass. A big GEMM alone, or
one short round, would mislead: on shared or quota-limited machines (VMs with more vCPUs
than CPU time) every parallel region can stall for milliseconds, now and then, and small
operations, not GEMMs, then decide the speed. On a quiet 2-core machine two threads win (the
mixed workload ran 1.6-2x faster with 2 than with 1); where a second thread only fights the
event loop or a neighbour, one wins. ``default_thread_count`` caches a short measurement once
per process and dtype.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections.abc import Callable

import torch

from tgengine.models.gemm import Gemm, LinearWeights

log = logging.getLogger(__name__)

_ROUNDS = 5
# The median of the rounds, not their worst: with the worst of three, one stall in a round at
# two threads picked one thread in 4 of 10 fresh starts on a quiet 2-core machine (Zen 5,
# bench threads: 0.58x the best fixed count's throughput), and in 1 of 8 probes alone.
_ENGINE_ROUND_SECONDS = 0.05
# A close call (the runner-up's median within this fraction of the best's), or a pick of fewer
# threads than cores, is measured in a second pass, and each count keeps its better pass. On
# the 2-core Zen 4 VM a stretch of about 0.4 s where the second vCPU ran something else made
# two threads measure as one (1 of 20 probes run alone: medians 186 against 185 GFLOP/s,
# where two threads run 1.6x one). When a close call's ten rounds decided together (their
# median), bench threads still saw 1 start of 10 pick one thread (0.60x the best fixed
# count): a stall over half of them decides a median. A stall in one pass does not decide the
# better of two.
_CLOSE = 0.1


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def fastest_thread_count(dtype: torch.dtype, seconds: float) -> tuple[int, dict[str, float]]:
    """The best thread count and each count's rate (FLOP/s): its median round in a pass.

    A second pass runs where the first one's call is close (``is_close_call``) or picked fewer
    threads than there are candidates; each count then keeps its better pass
    (``pick_count``). Leaves torch at the thread count it found.
    """
    candidates = list(range(1, min(available_cores(), 8) + 1))
    gemm = Gemm()
    gemm.prepack = True  # the engine's default: packed weights where packing applies
    x = torch.randn(32, 576).to(dtype)
    w_in = LinearWeights([torch.nn.Linear(576, 1536, bias=False).to(dtype)])
    w_out = LinearWeights([torch.nn.Linear(1536, 576, bias=False).to(dtype)])
    gemm.pack(w_in)
    gemm.pack(w_out)

    def layer() -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        return gemm.linear(torch.nn.functional.silu(gemm.linear(h, w_in)), w_out)

    work = 2.0 * 2 * x.shape[0] * 576 * 1536
    with torch.inference_mode():
        passes = [measure_pass(layer, work, candidates, seconds)]
        if needs_second_pass(passes[0]):
            passes.append(measure_pass(layer, work, candidates, seconds))
    best, rates = pick_count(passes)
    torch.set_num_threads(best)
    return best, rates


def measure_pass(
    layer: Callable[[], object], work: float, candidates: list[int], seconds: float
) -> dict[str, float]:
    """Each count's median rate over ``_ROUNDS`` interleaved rounds of ``seconds``."""
    rounds: dict[str, list[float]] = {str(n): [] for n in candidates}
    for _ in range(_ROUNDS):
        for n in candidates:
            torch.set_num_threads(n)
            layer()
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                layer()
                count += 1
            rounds[str(n)].append(work * count / elapsed)
    return median_rates(rounds)


def median_rates(rounds: dict[str, list[float]]) -> dict[str, float]:
    """Each count's median round: one stalled round does not decide a pass."""
    return {n: statistics.median(r) for n, r in rounds.items()}


def is_close_call(rates: dict[str, float]) -> bool:
    """Whether the two best counts' rates are within ``_CLOSE`` of each other."""
    top = sorted(rates.values(), reverse=True)
    return len(top) > 1 and top[1] >= (1.0 - _CLOSE) * top[0]


def needs_second_pass(rates: dict[str, float]) -> bool:
    """Whether a pass's call must be confirmed: a close one, or fewer threads than candidates."""
    best = max(rates, key=lambda n: rates[n])
    return is_close_call(rates) or int(best) < max(int(n) for n in rates)


def pick_count(passes: list[dict[str, float]]) -> tuple[int, dict[str, float]]:
    """The count with the best rate, each count's rate the best of its passes' medians.

    A stall only slows a count down, so its better pass is its undisturbed speed.
    """
    rates = {n: max(p[n] for p in passes) for n in passes[0]}
    return int(max(rates, key=lambda n: rates[n])), rates


probe_rates: dict[torch.dtype, dict[str, float]] = {}
"""What ``default_thread_count`` measured, by dtype: each count's median rate (FLOP/s)."""


@functools.cache
def default_thread_count(dtype: torch.dtype) -> int:
    """``fastest_thread_count`` in short rounds (about 0.25 s per candidate), once per process."""
    if available_cores() == 1:
        return 1
    best, rates = fastest_thread_count(dtype, _ENGINE_ROUND_SECONDS)
    probe_rates[dtype] = rates
    log.info("torch threads: %d (GFLOP/s by count: %s)", best, _gflops(rates))
    return best


def _gflops(rates: dict[str, float]) -> str:
    return ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items())
