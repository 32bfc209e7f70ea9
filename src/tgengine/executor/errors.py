"""What an executor reports when one of its ranks fails: the ``__cause__`` of the
``EngineDeadError`` that ``Engine.run()`` raises. Both name the rank.

::

    WorkerError
     ├─ WorkerExited     the rank's process (or actor) is gone: killed, crashed, lost
     └─ WorkerFailed     the rank raised (in a forward step, or while loading)
"""

from __future__ import annotations

from ..process.errors import describe_status


class WorkerError(Exception):
    """A rank of a multi-process or Ray executor failed; ``rank`` says which."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


class WorkerExited(WorkerError):
    """The rank's process ended without a word; ``returncode`` as ``Popen`` gives it
    (negative: the signal that killed it), or ``reason`` for a lost Ray actor or node."""

    def __init__(
        self, rank: int, pid: int | None, returncode: int | None, reason: str | None = None
    ) -> None:
        self.pid = pid
        self.returncode = returncode
        if reason is None:
            reason = f"exited with status {describe_status(returncode)}"
        where = f" (pid {pid})" if pid is not None else ""
        super().__init__(rank, f"rank {rank} worker{where} {reason}")


class WorkerFailed(WorkerError):
    """The rank raised ``error`` (also this exception's ``__cause__``)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        self.error_type = type(error).__name__
        super().__init__(rank, f"rank {rank} raised {self.error_type}: {error}")
        self.__cause__ = error


def _rebuild(cls: type[WorkerError], args: tuple[object, ...], state: dict[str, object]) -> object:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
