"""tgengine: an LLM inference engine whose lifecycle is structured concurrency."""

from typing import TYPE_CHECKING, Any

from .runtime.openmp_policy import shorten_openmp_spin

shorten_openmp_spin()  # before anything loads torch (and with it OpenMP)

from .agent.agent import MemoryStats
from .config import EngineConfig
from .engine.client import EngineClient
from .engine.engine import Engine
from .errors import (
    CacheNotReadyError,
    EngineDeadError,
    EnginePausedError,
    EngineProcessExited,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
    ModelLoadError,
    TGEngineError,
)
from .open_engine import open_engine
from .outputs import RequestOutput
from .sampling import SamplingParams
from .state import EngineState
from .stats import EngineStats
from .structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from .process import ProcessEngine

__all__ = [
    "CacheNotReadyError",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EnginePausedError",
    "EngineProcessExited",
    "EngineSleepingError",
    "EngineState",
    "EngineStats",
    "EngineStoppedError",
    "IllegalStateError",
    "InvalidRequestError",
    "MemoryStats",
    "ModelLoadError",
    "ProcessEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TGEngineError",
    "open_engine",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine-process client loads on first use (an in-process engine never needs it).
    if name == "ProcessEngine":
        from .process import ProcessEngine

        return ProcessEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
