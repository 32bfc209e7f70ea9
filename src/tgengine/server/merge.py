"""``merged``: the chunks of several request streams, as they come, through one iterator."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ..engine.client import OutputStream
from ..outputs import RequestOutput

K = TypeVar("K")


@asynccontextmanager
async def merged(
    streams: Sequence[tuple[K, OutputStream]],
) -> AsyncIterator[AsyncIterator[tuple[K, RequestOutput]]]:
    """Iterate ``(key, chunk)`` over every stream, in arrival order.

    One stream is read directly. Several are each read by a task of one task group that
    feeds an unbounded channel (the engine's own streams are unbounded too). Leaving the
    block, however early, cancels the readers and closes every stream: each unfinished
    request is aborted.
    """
    if len(streams) == 1:
        key, stream = streams[0]
        async with stream:
            yield _keyed(key, stream)
        return
    send, receive = anyio.create_memory_object_stream[tuple[K, RequestOutput]](math.inf)
    async with anyio.create_task_group() as tg:
        for key, stream in streams:
            tg.start_soon(_pump, key, stream, send.clone())
        send.close()
        try:
            async with receive:
                yield receive
        finally:
            tg.cancel_scope.cancel()


async def _keyed(key: K, stream: OutputStream) -> AsyncIterator[tuple[K, RequestOutput]]:
    async for out in stream:
        yield key, out


async def _pump(
    key: K, stream: OutputStream, send: MemoryObjectSendStream[tuple[K, RequestOutput]]
) -> None:
    async with stream, send:
        async for out in stream:
            send.send_nowait((key, out))
