"""The exceptions tgengine raises, split by who is at fault: every one of them, in one tree.

::

    TGEngineError
     ├─ EngineSleepingError      request refused: a memory tag is not resident (server: 503)
     ├─ EnginePausedError        request refused: paused with mode="abort" (server: 503)
     ├─ EngineStoppedError       request refused: you stopped the engine (server: 503)
     ├─ EngineDeadError          the engine failed; __cause__ is the original exception (503)
     ├─ CacheNotReadyError       one request's KV cache is missing; becomes its error chunk
     ├─ IllegalStateError        a control call that the current state does not allow
     ├─ ModelLoadError           the model directory is missing, broken or unsupported
     ├─ InvalidRequestError      bad parameters or prompt; also a ValueError (server: 400)
     │
     │  faults of a transport: the __cause__ of an EngineDeadError, never raised to you alone
     ├─ StepTimeoutError         a forward step overran step_timeout; also a TimeoutError
     ├─ WorkerError              a rank of the mp or ray executor failed; names the rank
     │   ├─ WorkerExited         its process (or actor) is gone: killed, crashed, lost
     │   └─ WorkerFailed         it raised (its exception is the __cause__)
     ├─ EngineProcessExited      the engine process ended without a word (its exit status)
     └─ RemoteError              an exception of another process that could not cross as itself
"""

from __future__ import annotations

import signal


class TGEngineError(Exception):
    """Base class of every error tgengine raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Subclasses build their message from other arguments: rebuild from the state, so
        # an error crosses a process boundary (pickle) as itself.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(
    cls: type[TGEngineError], args: tuple[object, ...], state: dict[str, object]
) -> object:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class EngineSleepingError(TGEngineError):
    """A request was refused because a memory tag is not resident."""

    def __init__(self, sleeping_tags: frozenset[str] | set[str] = frozenset()) -> None:
        self.sleeping_tags = frozenset(sleeping_tags)
        tags = ", ".join(sorted(self.sleeping_tags)) or "unknown"
        super().__init__(f"engine is sleeping (not resident: {tags}); call wakeup() first")


class EnginePausedError(TGEngineError):
    """A request was refused because the engine is paused with ``mode="abort"``."""

    def __init__(self) -> None:
        super().__init__("engine is paused (mode='abort'); call resume() first")


class EngineStoppedError(TGEngineError):
    """A request was refused because the engine is stopping or stopped (you stopped it)."""

    def __init__(self, state: str = "stopped") -> None:
        self.state = state
        super().__init__(f"engine is {state}; it admits no new requests")


class EngineDeadError(TGEngineError):
    """The engine failed under you; ``__cause__`` holds the original exception."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(f"engine died: {reason}" if reason else "engine died")


class CacheNotReadyError(TGEngineError):
    """One request's KV cache is missing (released, not allocated, or its blocks invalid).

    Raised inside the ModelAgent for that request alone; it becomes the request's
    ``finish_reason="error"`` chunk while its siblings keep running.
    """

    def __init__(self, request_id: str, cause: str) -> None:
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"KV cache not ready for request {request_id!r}: {cause}")


class IllegalStateError(TGEngineError):
    """A control call that the engine's current state does not allow."""

    def __init__(self, action: str, state: str) -> None:
        self.action = action
        self.state = state
        super().__init__(f"cannot {action} while the engine is {state}")


class InvalidRequestError(TGEngineError, ValueError):
    """Bad request parameters or prompt. ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ModelLoadError(TGEngineError):
    """The model directory is missing, broken, or holds a model type tgengine cannot run."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"cannot load model {model!r}: {reason}")


class StepTimeoutError(TGEngineError, TimeoutError):
    """A forward step did not return within ``EngineConfig.step_timeout``: a fault."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(f"forward step did not return within step_timeout={timeout} s")


class WorkerError(TGEngineError):
    """A rank of a multi-process or Ray executor failed; ``rank`` says which."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


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


class EngineProcessExited(TGEngineError):
    """The engine process ended without a word: killed by a signal or exited on its own.

    The ``__cause__`` of the ``EngineDeadError`` that ``ProcessEngine.run()`` raises;
    ``returncode`` is the exit status (negative: the signal that killed it).
    """

    def __init__(self, pid: int, returncode: int | None) -> None:
        self.pid = pid
        self.returncode = returncode
        super().__init__(f"engine process {pid} exited with status {describe_status(returncode)}")


class RemoteError(TGEngineError):
    """An exception from another process that could not cross the boundary as itself."""

    def __init__(self, type_name: str, message: str) -> None:
        self.type_name = type_name
        super().__init__(f"{type_name}: {message}")


def describe_status(returncode: int | None) -> str:
    """A process's exit status in words: ``-9 (SIGKILL)``, ``1``, or still running."""
    if returncode is None:
        return "unknown (still running)"
    if returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return str(returncode)
    return str(returncode)
