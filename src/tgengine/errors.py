"""The exceptions tgengine raises, split by who is at fault.

::

    TGEngineError
     ├─ EngineSleepingError      request refused: a memory tag is not resident (server: 503)
     ├─ EnginePausedError        request refused: paused with mode="abort" (server: 503)
     ├─ EngineStoppedError       request refused: you stopped the engine (server: 503)
     ├─ EngineDeadError          the engine failed; __cause__ is the original exception (503)
     ├─ CacheNotReadyError       one request's KV cache is missing; becomes its error chunk
     ├─ IllegalStateError        a control call that the current state does not allow
     ├─ ModelLoadError           the model directory is missing, broken or unsupported
     └─ InvalidRequestError      bad parameters or prompt; also a ValueError (server: 400)
"""

from __future__ import annotations


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
