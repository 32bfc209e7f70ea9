"""The messages between ``ProcessEngine`` (parent) and ``EngineHost`` (engine process).

Parent → engine: ``Setup`` (first, once), ``Generate``, ``Abort``, ``Stop``, and control
calls: an ``ipc.calls.Request`` holding one of ``Pause``, ``Resume``, ``Sleep``, ``Wakeup``,
``UpdateWeights``, or an update in parts: ``UpdateBegin``, ``UpdatePart``s, then
``UpdateCommit`` or ``UpdateAbort`` (``ControlCommand``). Engine → parent: frames, each a
list of ``Ready``, ``Output``, ``Refused``, ``ipc.calls.Reply``, ``RequestFinished``,
``StepFinished`` or ``Final`` messages and the ``Snapshot`` taken as the frame was sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..agent.agent import MemoryStats
from ..config import EngineConfig
from ..engine.request_stats import RequestStats, StepStats
from ..executor import Executor
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..state import EngineState
from ..stats import EngineStats


@dataclass(frozen=True)
class Setup:
    """The engine to run: ``Engine(config)``, on ``executor_factory(config)`` if given."""

    config: EngineConfig
    executor_factory: Callable[[EngineConfig], Executor] | None = None


@dataclass(frozen=True)
class Generate:
    key: int  # the parent's id of this admission; request ids may be reused
    request_id: str
    token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Pause:
    mode: Literal["abort", "drain", "keep"]


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class Sleep:
    level: int
    mode: Literal["abort", "drain", "keep"]


@dataclass(frozen=True)
class Wakeup:
    tags: tuple[str, ...]


@dataclass(frozen=True)
class UpdateWeights:
    """A directory of safetensors (the parent writes tensors to one in ``/dev/shm``)."""

    source: str
    kept_kv: Literal["recompute", "reuse"] = "recompute"


@dataclass(frozen=True)
class UpdateBegin:
    """Open ``Engine.weight_update(kept_kv=...)`` in the engine process, as update ``update_id``
    (the parent's count: a late message of an earlier update is refused)."""

    update_id: int
    kept_kv: Literal["recompute", "reuse"] = "recompute"


@dataclass(frozen=True)
class UpdatePart:
    """Push the tensors of the safetensors file at ``path`` (in ``/dev/shm``; the sender
    removes it once answered, or, ``hold``, once the update ended) into the open update."""

    update_id: int
    path: str
    hold: bool = False


@dataclass(frozen=True)
class UpdateCommit:
    """Leave the update's block cleanly: everything pushed applies at once."""

    update_id: int


@dataclass(frozen=True)
class UpdateAbort:
    """Leave the update's block with an error: nothing applies."""

    update_id: int


ControlCommand = (
    Pause
    | Resume
    | Sleep
    | Wakeup
    | UpdateWeights
    | UpdateBegin
    | UpdatePart
    | UpdateCommit
    | UpdateAbort
)


@dataclass(frozen=True)
class Stop:
    grace: float


@dataclass(frozen=True)
class Snapshot:
    """What the parent answers synchronously from: state, stats, memory, admission."""

    state: EngineState
    sleeping_tags: frozenset[str]
    weight_version: int
    stats: EngineStats
    memory: dict[str, MemoryStats]
    refusal: BaseException | None  # what generate() would raise now, if anything
    clock: float  # the engine process's anyio.current_time() when taken


@dataclass(frozen=True)
class Ready:
    model_config: Any
    max_model_len: int
    pid: int


@dataclass(frozen=True)
class Output:
    key: int
    chunk: RequestOutput


@dataclass(frozen=True)
class Refused:
    key: int
    error: BaseException


@dataclass(frozen=True)
class RequestFinished:
    """For the parent's ``EngineObserver``s: a request finished (times: ``time.monotonic``,
    one clock for every process of the machine)."""

    stats: RequestStats


@dataclass(frozen=True)
class StepFinished:
    stats: StepStats


@dataclass(frozen=True)
class Final:
    """The last message: the engine returned (``cause`` None) or died of ``cause``."""

    cause: BaseException | None


@dataclass(frozen=True)
class Frame:
    messages: list[Any]
    snapshot: Snapshot | None
