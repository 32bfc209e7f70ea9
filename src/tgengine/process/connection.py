"""``Connection``: the parent's end of the socket to the engine process.

Messages are queued without waiting (``send``) and written in batches by one task; another
task reads the child's frames and hands each snapshot and message to the client.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio

from ..ipc.wire import Channel
from .messages import Frame, Snapshot


class Connection:
    """A send queue and the loops that write it and read the child's frames."""

    def __init__(self) -> None:
        self._outbox, self._outgoing = anyio.create_memory_object_stream[Any](math.inf)
        self.lost = anyio.Event()  # set once the child's end of the socket has closed

    def send(self, message: Any) -> None:
        """Queue ``message`` for the child; dropped once the connection is lost."""
        if not self.lost.is_set():
            self._outbox.send_nowait(message)

    async def write_loop(self, channel: Channel) -> None:
        """Sends what ``send`` queued, batched; returns only when cancelled or broken."""
        while True:
            batch = [await self._outgoing.receive()]
            while True:
                try:
                    batch.append(self._outgoing.receive_nowait())
                except anyio.WouldBlock:
                    break
            try:
                await channel.send(batch)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return  # the reader sees the end of the stream too

    async def read_loop(
        self,
        channel: Channel,
        scope: anyio.CancelScope,
        on_snapshot: Callable[[Snapshot], None],
        on_message: Callable[[Any], None],
    ) -> None:
        """Dispatches the child's frames until its end of the socket closes, then sets
        ``lost`` and cancels ``scope``."""
        try:
            while True:
                frame: Frame = await channel.receive()
                if frame.snapshot is not None:
                    on_snapshot(frame.snapshot)
                for message in frame.messages:
                    on_message(message)
        except anyio.EndOfStream:
            self.lost.set()
            scope.cancel()
