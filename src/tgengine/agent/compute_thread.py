"""``ComputeThread``: the one OS thread that runs all of an agent's torch work.

The agent's blocking calls (load, forward and sampling, sleep, wakeup, updates) run here,
not in ``anyio.to_thread``'s worker threads, which come and go: each thread that starts an
OpenMP parallel region keeps a team of OpenMP threads, and once libgomp manages more of them
than there are cores its barriers barely spin (``runtime.openmp_policy``): a one-sequence
decode step ran 2x slower at 2 threads. The event loop awaits a call (``run``) without a
worker thread between: the compute thread tells the loop itself when the call returned, as
anyio's workers do (``call_soon_threadsafe`` / ``run_sync_soon``): two thread wake-ups a
step instead of four. On the 2-core Zen 4 VM of docs/benchmarks.md the way there and back
took 0.43 ms of a 10.2 ms one-sequence decode step (0.47 with a worker between: most of it
is that VM's wake-up latency). Cancelling ``run`` with ``abandon`` abandons the wait, and the
call finishes here on its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import anyio
import anyio.lowlevel

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

    async def run(self, fn: Callable[..., T], *args: Any, abandon: bool = False) -> T:
        """``fn(*args)`` on the compute thread, awaited: the event loop runs on meanwhile.

        Cancelled, it waits for the call to return (shielded), or with ``abandon`` returns at
        once and leaves the call to finish on its own. ``RuntimeError`` once closed."""
        done = anyio.Event()
        notify = _notifier(anyio.lowlevel.current_token(), done.set)
        future = self._pool.submit(_call_then, notify, fn, *args)
        try:
            await done.wait()
        except BaseException:
            if not abandon:
                with anyio.CancelScope(shield=True):
                    await done.wait()
            raise
        return future.result()

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


def _call_then(notify: Callable[[], None], fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        notify()


def _notifier(token: anyio.lowlevel.EventLoopToken, fn: Callable[[], None]) -> Callable[[], None]:
    """A callable for another thread that has the event loop of ``token`` call ``fn`` soon,
    without waiting for it; nothing once that loop has ended (nobody waits then).
    (``anyio.from_thread.run_sync(fn, token=token)`` would block the compute thread until the
    loop ran ``fn``: a wake-up back to it each call. anyio has no call that does not wait, so
    this uses each backend's own, as anyio's worker threads do.)"""
    native = token.native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        loop = native

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop is closed: nobody waits for the call
                return

        return notify
    import trio  # the one other backend anyio runs on

    trio_token = cast(trio.lowlevel.TrioToken, native)

    def notify_trio() -> None:
        try:
            trio_token.run_sync_soon(fn)
        except trio.RunFinishedError:  # the run has ended: nobody waits for the call
            return

    return notify_trio
