"""Every peer at every thread count, one after the other: the loop the benches share."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..common import BenchSetup
from ..roofline import MachineLimits
from .llamacpp_peer import run_llamacpp
from .spec import PeerRunError, PeerSpec, Threads
from .vllm_peer import run_vllm

# vLLM's first start compiles for minutes; a full workload at one thread takes more.
DEFAULT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class PeerPlan:
    """Which peers to run, at which thread counts, and how long each run may take."""

    peers: tuple[PeerSpec, ...] = ()
    threads: tuple[Threads, ...] = (1, 2)
    timeout_s: float = DEFAULT_TIMEOUT_S
    log_dir: str | None = None  # keep each peer's log here (default: a temporary directory)


@dataclass
class PeerRun:
    """One peer at one thread count: its result dict, or why it failed."""

    peer: PeerSpec
    threads: Threads
    result: dict[str, Any] | None = None
    error: str | None = None
    matmul_before_after: tuple[float, float] | None = None  # see run_peers' measure

    @property
    def label(self) -> str:
        return self.peer.label(self.threads)

    def info(self) -> dict[str, Any]:
        """What the report says about this run besides its figures."""
        if self.result is None:
            return {"error": self.error}
        return {k: self.result[k] for k in ("version", "startup_s") if k in self.result}


def run_peers(
    plan: PeerPlan,
    make_job: Callable[[Threads], dict[str, Any]],
    *,
    progress: bool = True,
    measure: Callable[[Threads], float] | None = None,
) -> Iterator[PeerRun]:
    """Run ``make_job(threads)`` on each peer at each thread count, in order.

    A peer that fails is reported (``PeerRun.error``) and the loop goes on with the next.
    ``measure(threads)``, if given, is called just before and just after each run (the GEMM
    rate around it: ``PeerRun.matmul_before_after``).
    """
    for peer in plan.peers:
        for threads in plan.threads:
            run = PeerRun(peer, threads)
            if progress:
                print(f"peer {run.label}: running", file=sys.stderr, flush=True)
            runner = run_vllm if peer.kind == "vllm" else run_llamacpp
            before = measure(threads) if measure is not None else None
            try:
                run.result = runner(
                    peer, make_job(threads), timeout_s=plan.timeout_s, log_dir=plan.log_dir
                )
            except PeerRunError as exc:
                run.error = str(exc)
                print(f"peer {run.label}: failed: {exc}", file=sys.stderr, flush=True)
            if measure is not None and before is not None:
                run.matmul_before_after = (before, measure(threads))
            yield run


@dataclass
class LimitsByThreads:
    """The machine's limits at each thread count a peer ran with, measured once each."""

    setup: BenchSetup
    base: MachineLimits
    _measured: dict[int, MachineLimits] = field(default_factory=dict)

    def at(self, threads: Threads) -> MachineLimits:
        """At ``threads`` (a peer's own default: at the bench's threads)."""
        if isinstance(threads, str) or threads == self.base.threads:
            return self.base
        if threads not in self._measured:
            self._measured[threads] = self.setup.measure_machine(threads)
        return self._measured[threads]


def best_by_kind(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """For each peer kind among ``rows`` (those with a ``peer`` field), its row with the
    highest ``key``."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        kind = row.get("peer")
        if kind and (kind not in best or row[key] > best[kind][key]):
            best[kind] = row
    return best
