"""Executors run the ModelAgent(s): in-process today, multi-process or Ray later."""

from .base import Executor
from .uni_executor import UniExecutor

__all__ = ["Executor", "UniExecutor"]
