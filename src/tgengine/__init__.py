"""tgengine: an LLM inference engine whose lifecycle is structured concurrency."""

from .config import EngineConfig
from .engine import Engine
from .engine_client import EngineClient
from .errors import (
    CacheNotReadyError,
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
    ModelLoadError,
    TGEngineError,
)
from .model_agent import MemoryStats
from .open_engine import open_engine
from .outputs import RequestOutput
from .process import EngineProcessExited, ProcessEngine
from .sampling import SamplingParams
from .state import EngineState
from .stats import EngineStats
from .structured_outputs import StructuredOutputsParams

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
