"""The engine in its own process: ``ProcessEngine``, its errors, and ``EngineSupervisor``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import EngineProcessExited, RemoteError

if TYPE_CHECKING:
    from .client import ProcessEngine
    from .supervisor import EngineSupervisor, RestartPolicy

__all__ = [
    "EngineProcessExited",
    "EngineSupervisor",
    "ProcessEngine",
    "RemoteError",
    "RestartPolicy",
]


def __getattr__(name: str) -> Any:
    # The client and the supervisor load on first use: an in-process engine (and
    # ``python -m tgengine generate``) needs only the error types, not their imports.
    if name == "ProcessEngine":
        from .client import ProcessEngine

        return ProcessEngine
    if name in ("EngineSupervisor", "RestartPolicy"):
        from . import supervisor

        return getattr(supervisor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
