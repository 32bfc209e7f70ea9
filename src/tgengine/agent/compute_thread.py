"""``ComputeThread``: the one OS thread that runs all of an agent's torch work.

The agent's blocking calls (load, forward and sampling, sleep, wakeup, updates) reach it
through ``anyio.to_thread.run_sync``, whose worker threads come and go; each thread that
starts an OpenMP parallel region keeps a team of OpenMP threads, and once libgomp manages
more of them than there are cores its barriers barely spin (``runtime.openmp_policy``): a
one-sequence decode step ran 2x slower at 2 threads. So each call is handed on to this
thread, and the anyio worker only waits for it: cancelling (``abandon_on_cancel``) still
abandons the wait, and the call finishes here on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    """Runs callables one at a time on one thread of its own; ``close`` lets it go."""

    def __init__(self, name: str = "tgengine-compute") -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._started)
        self._ident: int | None = None
        self._thread: threading.Thread | None = None
        self.closed = False
        """Set by ``close``: ``call`` raises from then on."""

    def _started(self) -> None:
        self._ident = threading.get_ident()
        self._thread = threading.current_thread()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread (at once if this is it), blocking until done."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    def close(self, timeout: float = 0.0) -> bool:
        """No more calls; the thread ends once the call in flight (if any) returns. Waits up
        to ``timeout`` seconds for that (blocking); returns whether the thread has ended."""
        self.closed = True
        self._pool.shutdown(wait=False)
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()
