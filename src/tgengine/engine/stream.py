"""``RequestStream``: what ``Engine.generate`` returns — one request's chunks."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ..outputs import RequestOutput
from .requests import Request


class ChunkStream:
    """The consumer side of one request's chunks: iteration, closing, letting go.

    Subclasses set ``_receive`` and define ``_let_go`` (what happens when the consumer
    stops reading: abort the request, close the stream).
    """

    _receive: MemoryObjectReceiveStream[RequestOutput]

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None
        except BaseException:
            self._let_go()  # cancelled while waiting: nobody will read the rest
            raise

    async def aclose(self) -> None:
        self._let_go()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._let_go()

    def __del__(self) -> None:
        self._let_go()

    def _let_go(self) -> None:
        raise NotImplementedError


class RequestStream(ChunkStream):
    """An async iterator over one admitted request's ``RequestOutput`` chunks.

    With ``n > 1`` it carries the chunks of all ``n`` sequences (``RequestOutput.index``)
    and ends after the last one finished. The request is aborted, and its KV blocks
    freed, as soon as the consumer lets go: when it breaks out of ``async for`` (the stream
    is dropped), is cancelled while waiting for a chunk, or calls ``aclose()``. The abort
    is synchronous, so it has happened by the time the consumer's next line runs.
    """

    def __init__(
        self,
        requests: list[Request],
        receive: MemoryObjectReceiveStream[RequestOutput],
        abort: Callable[[Request], None],
    ) -> None:
        self._requests = requests
        self._receive = receive
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self._requests[0].public_id

    def _let_go(self) -> None:
        for request in reversed(self._requests):  # the leader last: nobody waits for it
            if not request.finished:
                self._abort(request)
        self._receive.close()
