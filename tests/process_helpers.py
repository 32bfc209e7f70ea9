"""Helpers for tests that start engine processes: who is a child of this test process."""

from __future__ import annotations

import psutil


def child_pids() -> set[int]:
    """Every live process below this one (tests count them before and after)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if _alive(p)}


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_pids() -> list[int]:
    """This test process's ``mp`` executor workers (``tgengine.executor.mp_worker``)."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if _alive(p) and "tgengine.executor.mp_worker" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def still_running(processes: list[psutil.Process]) -> list[int]:
    """The pids of ``processes`` that still run (zombies and the gone do not)."""
    return [p.pid for p in processes if _alive(p)]
