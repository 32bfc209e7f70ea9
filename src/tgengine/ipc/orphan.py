"""``ParentWatch``: a child process notices that its parent is gone, and exits soon after.

Two signs of a dead parent: the end of the socket stream (the caller reports it with
``orphaned()``), and a changed parent pid, polled (a leaked copy of the socket could keep
the stream open). Once orphaned, a watchdog thread ends the process after ``grace``
seconds, whatever the clean-up is doing.
"""

from __future__ import annotations

import os
import threading

import anyio

PARENT_POLL = 0.5  # seconds between checks that the parent is alive
ORPHAN_EXIT = 3.0  # seconds an orphan gets to stop before it exits hard
ORPHAN_STATUS = 3  # the exit status of an orphan ended by the watchdog


class ParentWatch:
    """Watches this process's parent (the one it had when this was built)."""

    def __init__(self, grace: float = ORPHAN_EXIT) -> None:
        self.grace = grace
        self.parent_pid = os.getppid()
        self.is_orphaned = False

    async def watch(self, scope: anyio.CancelScope) -> None:
        """Poll the parent; once it is gone, start the watchdog and cancel ``scope``.

        Returns only then (or when cancelled).
        """
        # Polling: nothing announces a parent's death but the socket.
        while os.getppid() == self.parent_pid:  # noqa: ASYNC110
            await anyio.sleep(PARENT_POLL)
        self.orphaned()
        scope.cancel()

    def orphaned(self) -> None:
        """The parent is gone: exit with ``ORPHAN_STATUS`` in ``grace`` seconds at most."""
        if self.is_orphaned:
            return
        self.is_orphaned = True
        watchdog = threading.Timer(self.grace, os._exit, args=(ORPHAN_STATUS,))
        watchdog.daemon = True
        watchdog.start()
