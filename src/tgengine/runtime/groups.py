"""Exception-group helpers for the public boundary."""

from __future__ import annotations

from collections.abc import Iterator

import anyio


def root_cause(exc: BaseException) -> BaseException:
    """The first leaf of ``exc`` that is not a cancellation (``exc`` itself if not a group)."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = list(_leaves(exc))
    for leaf in leaves:
        if not isinstance(leaf, cancelled):
            return leaf
    return leaves[0] if leaves else exc


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
