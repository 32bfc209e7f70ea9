"""``EngineClient``: the public engine API, whoever runs the engine.

``Engine`` (in this process) and ``ProcessEngine`` (the engine in a child process) both
meet it, so the server, the CLI and tests hold an ``EngineClient`` and do not care which.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import anyio.abc

from ..config import EngineConfig
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..state import MEMORY_TAGS, EngineState
from ..stats import EngineStats

if TYPE_CHECKING:
    import torch

    from ..agent.agent import MemoryStats
    from .request_stats import EngineObserver


class OutputStream(Protocol):
    """One admitted request's chunks; letting go of it (break, cancel, ``aclose``) aborts it."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> None: ...


class PartsUpdate(Protocol):
    """An update in parts (``weight_update()``): ``async with`` it, ``push`` each part."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> None: ...

    async def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    async def push_file(self, path: str | Path, *, hold: bool = False) -> None: ...


class EngineClient(Protocol):
    """What ``Engine`` offers its users; DESIGN.md §2 gives the semantics."""

    config: EngineConfig
    observers: list[EngineObserver]  # told of every finished request and every step

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None: ...

    def stop(self, grace: float = 0.0) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> OutputStream: ...

    def abort(self, request_id: str) -> None: ...

    async def prepare_structured_outputs(self, params: SamplingParams) -> None: ...

    async def pause(self, mode: Literal["abort", "drain", "keep"] = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def sleep(
        self, level: int = 1, mode: Literal["abort", "drain", "keep"] = "abort"
    ) -> None: ...

    async def wakeup(self, tags: Iterable[str] = MEMORY_TAGS) -> None: ...

    async def update_weights(
        self,
        source: str | Path | Iterable[tuple[str, torch.Tensor]],
        *,
        kept_kv: Literal["recompute", "reuse"] = "recompute",
    ) -> None: ...

    def weight_update(
        self, *, kept_kv: Literal["recompute", "reuse"] = "recompute"
    ) -> PartsUpdate: ...

    def stats(self) -> EngineStats: ...

    def memory_stats(self) -> dict[str, MemoryStats]: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def is_sleeping(self) -> bool: ...

    @property
    def sleeping_tags(self) -> frozenset[str]: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def model_config(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...
