"""``RemoteCalls``: control calls to the engine process, each waiting for its reply."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import anyio

from .messages import Call, Reply


@dataclasses.dataclass
class _PendingCall:
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    error: BaseException | None = None


class RemoteCalls:
    """The calls sent to the engine process whose ``Reply`` has not arrived yet."""

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send
        self._pending: dict[int, _PendingCall] = {}
        self._ids = itertools.count()

    async def call(self, method: str, *args: Any) -> None:
        """Send ``method(*args)`` and wait for its reply; raise the error it carries.

        Cancellation stops the wait only: the call may still run in the engine process.
        """
        call_id = next(self._ids)
        call = self._pending[call_id] = _PendingCall()
        self._send(Call(call_id, method, args))
        try:
            await call.done.wait()
        finally:
            self._pending.pop(call_id, None)
        if call.error is not None:
            raise call.error

    def reply(self, message: Reply) -> None:
        call = self._pending.get(message.call_id)
        if call is not None:
            call.error = message.error
            call.done.set()

    def fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """End every pending call with its own ``make_error()``: no reply will come."""
        for call in self._pending.values():
            call.error = make_error()
            call.done.set()
