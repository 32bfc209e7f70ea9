"""Helpers for the Ray executor's tests: a local multi-node Ray, and who is still alive.

Everything here is importable by the rank actors too (``Boom`` crosses to them in a fault
plan), so it imports nothing heavy at module level.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

# Each node: one CPU (one rank), a small object store, no dashboard.
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
GONE_TIMEOUT = 30.0  # seconds for a killed process to disappear


class Boom(RuntimeError):
    """Raised by one rank, on purpose."""


@contextmanager
def two_node_cluster() -> Iterator[Any]:
    """A local Ray of two nodes (a head and a worker), both on 127.0.0.1; shut down after."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False}
    )
    try:
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def ensure_worker_node(cluster: Any) -> None:
    """Give ``cluster`` its worker node back if a test removed it."""
    if not cluster.worker_nodes:
        cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()


def rank_actor_pids() -> set[int]:
    """Live processes below this one that are rank actors (Ray titles them ray::RankActor)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "RankActor" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.Error:
            continue
    return found


def wait_gone(pids: Iterable[int], timeout: float = GONE_TIMEOUT) -> set[int]:
    """The processes of ``pids`` still alive after up to ``timeout`` seconds (want: none)."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return {p.pid for p in alive if _alive(p)}


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
