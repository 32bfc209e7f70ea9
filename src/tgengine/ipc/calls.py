"""One way to call across a process boundary: a typed command in a ``Request``, its
``Reply``, and the ``CallTracker`` that pairs them.

A command is a frozen dataclass, one per call; the receiver dispatches it with ``match``
(never by a name read from the wire) and answers with one ``Reply`` per ``Request``. The
caller's ``CallTracker`` holds each call until every peer it went to has answered (one for
the engine process; every rank for a broadcast to the ``mp`` executor's workers).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio


@dataclasses.dataclass(frozen=True)
class Request:
    call_id: int
    command: Any  # a frozen dataclass, one type per call


@dataclasses.dataclass(frozen=True)
class Reply:
    """``result`` of the command, or its ``error``; ``elapsed``: seconds the peer spent on
    it (the rest is transport)."""

    call_id: int
    result: Any = None
    error: BaseException | None = None
    elapsed: float = 0.0


@dataclasses.dataclass
class PendingCall:
    """One command sent to ``num_peers`` peers, awaiting their replies.

    ``done`` at the last reply or the first error; ``settled`` once every peer replied or
    is gone. After an error a caller may wait (briefly) for ``settled``: a peer that died
    makes the others fail too, and the lost peer is the cause to report.
    """

    command: Any
    num_peers: int = 1
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    errors: dict[int, BaseException] = dataclasses.field(default_factory=dict)
    lost: BaseException | None = None
    elapsed: float = 0.0  # the slowest peer's own time
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    settled: anyio.Event = dataclasses.field(default_factory=anyio.Event)

    def answer(self, peer: int, result: Any, elapsed: float = 0.0) -> None:
        self.results[peer] = result
        self.elapsed = max(self.elapsed, elapsed)
        self._check()

    def fail(self, peer: int, error: BaseException, *, lost: bool = False) -> None:
        """``peer`` answered with ``error``; ``lost``: the peer is gone (its error wins)."""
        if peer not in self.errors:  # a peer's first error is its error
            self.errors[peer] = error
            if lost and self.lost is None:
                self.lost = error
        self.done.set()
        self._check()

    def _check(self) -> None:
        if len(self.results) + len(self.errors) >= self.num_peers:
            self.done.set()
            self.settled.set()

    @property
    def error(self) -> BaseException | None:
        """A lost peer's error if any (the others' follow from it), else the first error."""
        return self.lost or next(iter(self.errors.values()), None)

    def results_by_peer(self) -> list[Any]:
        return [self.results[peer] for peer in range(self.num_peers)]


class CallTracker:
    """The calls sent whose replies have not all arrived, by call id."""

    def __init__(self) -> None:
        self._pending: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)

    @contextmanager
    def open(self, command: Any, num_peers: int = 1) -> Iterator[tuple[Request, PendingCall]]:
        """A new call of ``command``: the ``Request`` to send and the call to wait on.

        Tracked until the block exits: a reply that comes after (its caller was cancelled)
        is dropped.
        """
        call_id = next(self._ids)
        call = self._pending[call_id] = PendingCall(command, num_peers)
        try:
            yield Request(call_id, command), call
        finally:
            del self._pending[call_id]

    def get(self, call_id: int) -> PendingCall | None:
        return self._pending.get(call_id)

    def reply(self, reply: Reply, peer: int = 0) -> None:
        """Record ``peer``'s reply (nothing once its caller has left)."""
        call = self._pending.get(reply.call_id)
        if call is None:
            return
        if reply.error is not None:
            call.fail(peer, reply.error)
        else:
            call.answer(peer, reply.result, reply.elapsed)

    def fail_all(
        self, peer: int, make_error: Callable[[], BaseException], *, lost: bool = False
    ) -> None:
        """Every pending call gets ``make_error()`` from ``peer``: it will not reply."""
        for call in self._pending.values():
            call.fail(peer, make_error(), lost=lost)

    def __iter__(self) -> Iterator[PendingCall]:
        return iter(list(self._pending.values()))
