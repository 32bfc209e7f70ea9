"""``RemoteStream``: one request's chunks as they arrive from the engine process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..engine.stream import ChunkStream
from ..outputs import FinishReason, RequestOutput


@dataclass(eq=False)
class RemoteRequest:
    """The parent's record of one admitted request."""

    key: int
    request_id: str
    num_prompt_tokens: int
    send: MemoryObjectSendStream[RequestOutput]
    n: int = 1  # sequences; each ends with its own final chunk
    ended: set[int] = field(default_factory=set)
    finished: bool = False  # every sequence ended, or the consumer let go

    def deliver(self, chunk: RequestOutput) -> bool:
        """Pass ``chunk`` on; False once the consumer is gone. The n-th final chunk ends it."""
        if self.finished:
            return True
        if chunk.finished:
            self.ended.add(chunk.index)
            self.finished = len(self.ended) >= self.n
        try:
            self.send.send_nowait(chunk)
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        finally:
            if self.finished:
                self.send.close()

    def end(self, reason: FinishReason, error: str | None, weight_version: int) -> None:
        """End it here: a final chunk of no tokens for every sequence that has not ended
        (the engine cannot send them)."""
        for index in range(self.n):
            if index not in self.ended:
                chunk = RequestOutput(
                    request_id=self.request_id,
                    finish_reason=reason,
                    error=error,
                    weight_version=weight_version,
                    num_prompt_tokens=self.num_prompt_tokens,
                    index=index,
                )
                self.deliver(chunk)


class RemoteStream(ChunkStream):
    """An async iterator over one admitted request's chunks; ``RequestStream``'s semantics.

    Letting go (breaking out of ``async for``, cancellation while waiting, ``aclose()``,
    or dropping the stream) aborts the request at once: no chunk reaches it afterwards,
    and the engine process frees its KV blocks as soon as the abort arrives.
    """

    def __init__(
        self,
        request: RemoteRequest,
        receive: MemoryObjectReceiveStream[RequestOutput],
        let_go: Callable[[RemoteRequest], None],
    ) -> None:
        self._request = request
        self._receive = receive
        self._let_go_request = let_go

    @property
    def request_id(self) -> str:
        return self._request.request_id

    def _let_go(self) -> None:
        if not self._request.finished:
            self._let_go_request(self._request)
        self._receive.close()
