"""``PeakRSS``: processes' peak RSS over an action, from Linux's high-water mark.

``VmHWM`` in ``/proc/PID/status`` is a process's peak RSS so far; writing ``5`` to
``/proc/PID/clear_refs`` resets it to the RSS of the moment (Linux 4.0 and later, for a
process of the same user). So the peak over an action is exact and costs nothing while it
runs. A sampler (psutil every millisecond, some 50 us a process each time) can miss a peak
shorter than its period, and took about 15 % of a core from the update it measured on the
2-core machine of docs/server.md. Where the mark cannot be reset (not Linux, another
user's process), ``watching`` samples the RSS every millisecond instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import psutil

SAMPLE_PERIOD = 0.001  # seconds between two RSS readings, for a process without a mark


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess:
        return 0


def _high_water_mark(pid: int) -> int | None:
    """``VmHWM`` in bytes; None where the kernel does not report it (or the process is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def _reset_high_water_mark(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return _high_water_mark(pid) is not None


class PeakRSS:
    """Each named process's peak RSS above its RSS at ``start``: its high-water mark, reset
    by ``start``, where Linux allows; else the largest RSS that ``sample`` saw
    (``watching`` does both)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = dict(pids)
        self._base: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self._marked: set[str] = set()

    @property
    def needs_sampling(self) -> bool:
        """Whether some process has no mark: then call ``sample`` while the action runs."""
        return bool(set(self._pids) - self._marked)

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[PeakRSS]:
        """``start``, then, while the block runs, ``sample`` every ``SAMPLE_PERIOD`` where a
        process has no mark (nothing runs beside the block where all have one)."""
        self.start()
        if not self.needs_sampling:
            yield self
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sample_forever)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def _sample_forever(self) -> None:
        while True:
            self.sample()
            await anyio.sleep(SAMPLE_PERIOD)

    def start(self) -> None:
        """From now on (call it right before the action)."""
        self._marked = {role for role, pid in self._pids.items() if _reset_high_water_mark(pid)}
        self._base = {role: _rss(pid) for role, pid in self._pids.items()}
        self._seen = dict(self._base)

    def sample(self) -> None:
        """Read the RSS of the processes without a mark."""
        for role, pid in self._pids.items():
            if role not in self._marked:
                self._seen[role] = max(self._seen[role], _rss(pid))

    def peaks(self) -> dict[str, int]:
        """Each process's peak RSS since ``start``, above its RSS then (bytes)."""
        self.sample()
        found = {}
        for role, pid in self._pids.items():
            mark = _high_water_mark(pid) if role in self._marked else None
            peak = max(self._seen[role], mark or 0)
            found[role] = peak - self._base[role]
        return found
