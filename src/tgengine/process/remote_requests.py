"""``RemoteRequests``: the requests admitted to one engine process, by key and by id."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, Literal

import anyio

from ..engine.requests import sequence_ids
from ..errors import (
    EnginePausedError,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
)
from ..sampling import SamplingParams
from .messages import Abort, Generate, Output, Refused
from .remote_stream import RemoteRequest, RemoteStream

# Refusals the child makes after the parent admitted (a race with a control call): the
# request ends with this reason, as if admitted an instant before the state changed.
REFUSED_AS_ABORT = (EngineStoppedError, EnginePausedError, EngineSleepingError, IllegalStateError)


class RemoteRequests:
    """Each admitted request's record until its last chunk, its abort, or its consumer leaves.

    A request is known by a key (unique in this client, on the wire) and by its
    ``request_id`` (unique among live requests, what ``abort`` names).
    """

    def __init__(self, send: Callable[[Any], None]) -> None:
        self._send = send
        self._by_key: dict[int, RemoteRequest] = {}
        self._keys_by_id: dict[str, int] = {}
        self._keys = itertools.count()

    def admit(
        self, token_ids: list[int], params: SamplingParams, request_id: str | None
    ) -> RemoteStream:
        """Register a request, send it to the engine process, return its stream."""
        key = next(self._keys)
        if request_id is None:
            request_id = f"req-{key}"
        elif any(self._in_use(i) for i in {request_id, *sequence_ids(request_id, params.n)}):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        request = RemoteRequest(key, request_id, len(token_ids), send, n=params.n)
        self._by_key[key] = request
        self._keys_by_id[request_id] = key
        self._send(Generate(key, request_id, token_ids, params))
        return RemoteStream(request, receive, self._let_go)

    def _in_use(self, request_id: str) -> bool:
        """As the engine's own check: a live request's id, or the id of a live request's
        sequence that has not ended (``sequence_ids``)."""
        if request_id in self._keys_by_id:
            return True
        stem = request_id.rpartition("#")[0]
        key = self._keys_by_id.get(stem)
        request = self._by_key.get(key) if key is not None else None
        if request is None:
            return False
        ids = sequence_ids(stem, request.n)
        return request_id in ids and ids.index(request_id) not in request.ended

    def abort(self, request_id: str) -> None:
        """Ask the engine process to abort; the final chunk comes from there."""
        if self._keys_by_id.pop(request_id, None) is not None:
            self._send(Abort(request_id))

    def deliver(self, message: Output) -> None:
        request = self._by_key.get(message.key)
        if request is None:
            return  # let go of, or aborted here already
        if not request.deliver(message.chunk):
            self._let_go(request)
        elif request.finished:
            self._forget(request)

    def refuse(self, message: Refused, weight_version: int) -> None:
        request = self._by_key.get(message.key)
        if request is not None:
            error = message.error
            reason: Literal["abort", "error"] = (
                "abort" if isinstance(error, REFUSED_AS_ABORT) else "error"
            )
            request.end(reason, str(error), weight_version)
            self._forget(request)

    def end_all(
        self, reason: Literal["abort", "error"], error: str | None, weight_version: int
    ) -> None:
        """End every request here with ``reason`` (the engine process cannot any more)."""
        for request in list(self._by_key.values()):
            request.end(reason, error, weight_version)
        self._by_key.clear()
        self._keys_by_id.clear()

    def _let_go(self, request: RemoteRequest) -> None:
        request.finished = True
        request.send.close()
        self._by_key.pop(request.key, None)
        if self._keys_by_id.get(request.request_id) == request.key:
            del self._keys_by_id[request.request_id]
            self._send(Abort(request.request_id))

    def _forget(self, request: RemoteRequest) -> None:
        self._by_key.pop(request.key, None)
        if self._keys_by_id.get(request.request_id) == request.key:
            del self._keys_by_id[request.request_id]
