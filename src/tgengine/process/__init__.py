"""The engine in its own process: ``ProcessEngine``, its errors, and ``EngineSupervisor``."""

from .client import ProcessEngine
from .errors import EngineProcessExited, RemoteError
from .supervisor import EngineSupervisor, RestartPolicy

__all__ = [
    "EngineProcessExited",
    "EngineSupervisor",
    "ProcessEngine",
    "RemoteError",
    "RestartPolicy",
]
