"""The engine in its own process: ``ProcessEngine`` and the errors its ``run()`` reports."""

from .client import ProcessEngine
from .errors import EngineProcessExited, RemoteError

__all__ = ["EngineProcessExited", "ProcessEngine", "RemoteError"]
