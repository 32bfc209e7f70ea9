"""``RequestStream``: what ``Engine.generate`` returns — one request's chunks."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio

from .outputs import RequestOutput
from .requests import Request


class RequestStream:
    """An async iterator over one admitted request's ``RequestOutput`` chunks.

    The request is aborted, and its KV blocks freed, as soon as the consumer lets go:
    when it breaks out of ``async for`` (the stream is dropped), is cancelled while
    waiting for a chunk, or calls ``aclose()``. The abort is synchronous, so it has
    happened by the time the consumer's next line runs.
    """

    def __init__(self, request: Request, abort: Callable[[Request], None]) -> None:
        assert request.receive is not None
        self._request = request
        self._receive = request.receive
        self._abort = abort

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def __aiter__(self) -> RequestStream:
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

    async def __aenter__(self) -> RequestStream:
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
        if not self._request.finished:
            self._abort(self._request)
        self._receive.close()
