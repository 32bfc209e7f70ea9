"""``StartedOnce``: a task status that remembers whether ``started()`` was called."""

from __future__ import annotations

from typing import Generic, TypeVar

import anyio.abc

T = TypeVar("T")


class StartedOnce(Generic[T]):
    """Wraps ``status``; ``called`` tells a task that failed whether its parent is still
    waiting in ``start()`` (then it must call ``started()`` or raise)."""

    def __init__(self, status: anyio.abc.TaskStatus[T]) -> None:
        self.status = status
        self.called = False

    def started(self, value: T | None = None) -> None:
        self.called = True
        self.status.started(value)  # type: ignore[arg-type]
