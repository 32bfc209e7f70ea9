"""``EngineSupervisor``: an engine in its own process, started again when it dies.

It is an ``EngineClient`` itself, so a server holds it like any engine. While the engine
is down its state is ``DEAD``: ``generate`` raises ``EngineDeadError`` (the server answers
503 with Retry-After), control calls too, and ``stats()`` counts the restarts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from ..agent.agent import MemoryStats
from ..config import EngineConfig
from ..engine.client import EngineClient, OutputStream, PartsUpdate
from ..engine.request_stats import EngineObserver
from ..engine.weight_update import KeptKV
from ..errors import EngineDeadError
from ..runtime.groups import root_cause
from ..sampling import SamplingParams
from ..state import MEMORY_TAGS, EngineState
from ..stats import EngineStats
from .client import ProcessEngine

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
S = EngineState


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When to start a dead engine again.

    The n-th consecutive failed start waits ``initial_backoff * 2**(n-1)`` seconds (at most
    ``max_backoff``) before the next try; an engine that dies after it served is retried
    after ``initial_backoff``. After ``max_start_failures`` consecutive failed starts the
    supervisor gives up: ``run()`` raises ``EngineDeadError`` with the last cause.
    """

    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    max_start_failures: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError("initial_backoff: must be in [0, max_backoff]")
        if self.max_start_failures < 0:
            raise ValueError("max_start_failures: must be >= 0")

    def backoff(self, failures: int) -> float:
        return min(self.max_backoff, self.initial_backoff * 2 ** max(0, failures - 1))


class EngineSupervisor:
    """Runs ``ProcessEngine(config)`` and starts a new one whenever it dies.

    ``run()`` calls ``started()`` once the first engine serves; it returns after ``stop()``
    (or raises when cancelled) and raises ``EngineDeadError`` only after the policy's
    limit of consecutive failed starts. ``num_restarts`` counts the engines started after
    a death.
    """

    def __init__(
        self,
        config: EngineConfig,
        policy: RestartPolicy | None = None,
        *,
        engine_factory: Callable[[EngineConfig], EngineClient] = ProcessEngine,
    ) -> None:
        self.config = config
        self.policy = policy or RestartPolicy()
        self.num_restarts = 0
        self._factory = engine_factory
        self._engine: EngineClient | None = None  # the one serving, if any
        self._last: EngineClient | None = None  # the last one that served
        self._cause: BaseException | None = None
        self._stopping = False
        self._stop_grace = 0.0
        self._stop_event = anyio.Event()
        self._started = False
        self._served = anyio.Event()  # set (and replaced) each time an engine starts serving
        self.observers: list[EngineObserver] = []  # shared by every engine it starts

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        failures = 0
        while not self._stopping:
            served, cause = await self._run_one(task_status)
            if cause is None or self._stopping:
                return
            self._cause = cause
            failures = 1 if served else failures + 1
            reason = f"{type(cause).__name__}: {cause}"
            if not served and failures > self.policy.max_start_failures:
                message = f"gave up after {failures} failed starts; last: {reason}"
                raise EngineDeadError(message) from cause
            delay = self.policy.backoff(failures)
            log.warning("engine died (%s); starting a new one in %.1f s", reason, delay)
            with anyio.move_on_after(delay):
                await self._stop_event.wait()
            self.num_restarts += 1

    async def _run_one(
        self, task_status: anyio.abc.TaskStatus[None]
    ) -> tuple[bool, BaseException | None]:
        """Run one engine to its end: (whether it served, why it died or None)."""
        engine = self._factory(self.config)
        engine.observers = self.observers
        served = False
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                served = True
                self._engine = self._last = engine
                self._cause = None
                served_event, self._served = self._served, anyio.Event()
                served_event.set()
                if self._stopping:
                    engine.stop(self._stop_grace)
                if not self._started:
                    self._started = True
                    task_status.started()
        except Exception as exc:
            return served, root_cause(exc).__cause__ or root_cause(exc)
        finally:
            self._engine = None
        return served, None

    async def wait_serving(self, min_restarts: int = 0) -> None:
        """Return once an engine serves and at least ``min_restarts`` restarts happened.

        An RL loop that caught ``EngineDeadError`` waits here with the count it saw before,
        then pushes its weights again (a new engine starts from the model directory's).
        Cancellation just stops the wait.
        """
        while self._engine is None or self.num_restarts < min_restarts:
            await self._served.wait()

    def stop(self, grace: float = 0.0) -> None:
        """Stop the engine (``grace`` for its requests) and stop restarting; idempotent."""
        self._stopping = True
        self._stop_grace = max(0.0, grace)
        self._stop_event.set()
        if self._engine is not None:
            self._engine.stop(grace)

    def _serving(self, action: str) -> EngineClient:
        if self._engine is None:
            reason = f"{type(self._cause).__name__}: {self._cause}" if self._cause else "starting"
            raise EngineDeadError(f"restarting ({reason}); cannot {action}") from self._cause
        return self._engine

    # -- the engine's API, delegated ------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> OutputStream:
        return self._serving("generate").generate(prompt, params, request_id=request_id)

    async def prepare_structured_outputs(self, params: SamplingParams) -> None:
        await self._serving("generate").prepare_structured_outputs(params)

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)

    async def pause(self, mode: Literal["abort", "drain", "keep"] = "abort") -> None:
        await self._serving("pause").pause(mode)

    async def resume(self) -> None:
        await self._serving("resume").resume()

    async def sleep(
        self, level: int = 1, mode: Literal["abort", "drain", "keep"] = "abort"
    ) -> None:
        await self._serving("sleep").sleep(level, mode)

    async def wakeup(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        await self._serving("wake up").wakeup(tags)

    async def update_weights(
        self,
        source: str | Path | Iterable[tuple[str, torch.Tensor]],
        *,
        kept_kv: KeptKV = "recompute",
    ) -> None:
        await self._serving("update weights").update_weights(source, kept_kv=kept_kv)

    def weight_update(self, *, kept_kv: KeptKV = "recompute") -> PartsUpdate:
        """The serving engine's ``weight_update()`` (an engine that dies takes it along)."""
        return self._serving("update weights").weight_update(kept_kv=kept_kv)

    @property
    def pid(self) -> int | None:
        """The serving engine process's pid (None while down)."""
        return getattr(self._engine, "pid", None)

    @property
    def state(self) -> EngineState:
        if self._engine is not None:
            return self._engine.state
        if self._stopping:
            return S.STOPPED if self._last is not None else S.STOPPING
        return S.DEAD if self._last is not None else S.STARTING

    @property
    def is_sleeping(self) -> bool:
        return self._engine.is_sleeping if self._engine else False

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return self._engine.sleeping_tags if self._engine else frozenset()

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version if self._engine else 0

    @property
    def tokenizer(self) -> Any:
        return self._last.tokenizer if self._last else None

    @property
    def model_config(self) -> Any:
        return self._serving("read the model config").model_config

    @property
    def max_model_len(self) -> int:
        return self._last.max_model_len if self._last else 0

    def stats(self) -> EngineStats:
        if self._engine is not None:
            stats = self._engine.stats()
        else:
            stats = EngineStats(str(self.state), 0, 0, 0, 0, 0.0, 0, 0, None, 0, 0, 0)
        return dataclasses.replace(stats, num_restarts_total=self.num_restarts)

    def memory_stats(self) -> dict[str, MemoryStats]:
        return self._engine.memory_stats() if self._engine else {}
