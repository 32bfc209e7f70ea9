"""``Engine``: the public façade — admission, the request registry, the lifecycle state."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats
from ..config import EngineConfig
from ..errors import (
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
)
from ..executor import Executor, make_executor
from ..executor.base import AbsorbsParts, StagesWeights
from ..executor.uni_executor import UniExecutor
from ..outputs import FinishReason, RequestOutput
from ..runtime.groups import root_cause
from ..sampling import SamplingParams
from ..state import MEMORY_TAGS, EngineState
from ..stats import EngineStats
from ..structured_outputs.grammars import Grammars
from ..tokenization.tokenizer import load_tokenizer
from .admission import check_token_ids, encode_prompt
from .loop import EngineLoop
from .request_stats import EngineObserver
from .requests import new_requests
from .stream import RequestStream
from .weight_update import KeptKV, Named, UpdateSlot, WeightUpdate

PauseMode = Literal["abort", "drain", "keep"]
S = EngineState


class Engine:
    """An inference engine whose lifecycle is one ``run()`` in your task group.

    ``await tg.start(engine.run)`` loads the model and returns once it can serve;
    ``engine.stop()`` (or cancelling that task group) ends it. See DESIGN.md §2.
    ``executor`` runs the model (default: the one ``config.executor_kind`` names); a test
    passes a wrapped or fake one, as httpx's tests pass a transport.
    """

    def __init__(self, config: EngineConfig, *, executor: Executor | None = None) -> None:
        self.config = config
        executor = executor if executor is not None else make_executor(config)
        self._loop = EngineLoop(config, executor, _LoopOwner(self))
        self._info: AgentInfo | None = None  # what the loop started with
        self._state = S.STARTING
        self._run_called = False
        self._sleeping_tags: set[str] = set()
        self._resume_state = S.RUNNING
        self._pause_mode: PauseMode | None = None
        self._draining = False
        self._updates = UpdateSlot()
        self._tokenizer: Any = None
        self._grammars: Grammars | None = None  # once the tokenizer and the model are known
        self._control_lock = anyio.Lock()
        self._stop_event = anyio.Event()
        self._stop_grace = 0.0
        self._cause: BaseException | None = None
        self._ids = itertools.count()

    # -- lifecycle ------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the model, serve until stopped, then return.

        ``started()`` is called once the weights and the KV cache are ready. ``stop()``
        makes it return after the grace period; cancelling it is ``stop(grace=0)``. A
        fault anywhere below raises ``EngineDeadError`` with the fault as ``__cause__``,
        after every admitted request got its ``"error"`` chunk.
        """
        if self._run_called:
            raise IllegalStateError("run the engine twice", str(self._state))
        self._run_called = True
        try:
            async with anyio.create_task_group() as tg:
                # The thread count is measured on a quiet process; then the tokenizer (mostly
                # transformers' imports, GIL-bound) loads while the weights do (mostly I/O
                # and copies, which release the GIL).
                await self._loop.prepare()
                tokenizer_loaded = anyio.Event()
                tg.start_soon(self._load_tokenizer, tokenizer_loaded)
                self._info = await tg.start(self._loop.run)
                await tokenizer_loaded.wait()
                mc = self.model_config
                self._grammars = Grammars(self._tokenizer, mc.vocab_size, mc.eos_token_ids)
                if self._state is S.STARTING:
                    self._state = S.RUNNING
                task_status.started()
                await self._stop_event.wait()
                if self._can_step():
                    with anyio.move_on_after(self._stop_grace):
                        await self._loop.wait_until_idle()
                tg.cancel_scope.cancel()
        except Exception as exc:
            cause = root_cause(exc)
            self._die(cause)
            raise EngineDeadError(f"{type(cause).__name__}: {cause}") from cause
        finally:
            self._sleeping_tags.clear()  # nothing is resident, and nothing will wake up
            if self._state is not S.DEAD:
                self._end_all("abort")
                self._state = S.STOPPED

    async def _load_tokenizer(self, loaded: anyio.Event) -> None:
        source = self.config.tokenizer or self.config.model
        self._tokenizer = await anyio.to_thread.run_sync(
            load_tokenizer, source, self.config.tokenizer_mode
        )
        loaded.set()

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let admitted requests run up to ``grace`` seconds, abort the rest.

        ``run()`` then returns. Idempotent; a no-op once stopped or dead.
        """
        if self._state in (S.STOPPING, S.STOPPED, S.DEAD):
            return
        self._stop_grace = max(0.0, grace)
        self._state = S.STOPPING
        self._loop.finish_held("abort")
        self._stop_event.set()
        self._loop.notify()

    def _die(self, cause: BaseException) -> None:
        if self._state is S.DEAD:
            return
        self._state = S.DEAD
        self._cause = cause
        self._end_all("error", error=f"engine died: {type(cause).__name__}: {cause}")

    def _end_all(self, reason: FinishReason, error: str | None = None) -> None:
        self._loop.finish_all(reason, error)

    def _can_step(self) -> bool:
        if self._sleeping_tags:
            return False
        return self._state in (S.RUNNING, S.STOPPING) or self._draining

    # -- requests -------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Admit one request and return the stream of its chunks (use ``async for``).

        Admission errors are raised here, before any chunk. Once admitted, the request
        never raises: its last chunk has a ``finish_reason``. Breaking out of the loop,
        cancelling the consumer, or dropping the stream aborts the request and frees its
        KV blocks at once.
        """
        return self._admit(prompt, params or SamplingParams(), request_id)

    def _admit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None
    ) -> RequestStream:
        self.check_admission()
        vocab_size = self.model_config.vocab_size
        token_ids = encode_prompt(self._tokenizer, prompt, vocab_size, self.max_model_len)
        check_token_ids(params, vocab_size)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif self._loop.is_in_use(request_id):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        assert self._grammars is not None
        grammar = self._grammars.matcher(params.structured_outputs)
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        version, tokenizer = self._loop.weight_version, self._tokenizer
        requests = new_requests(request_id, token_ids, params, tokenizer, send, version)
        if any(self._loop.is_in_use(r.request_id) for r in requests):
            receive.close()
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        for request in requests:
            if request.index > 0:
                grammar = self._grammars.matcher(params.structured_outputs)
            request.grammar = grammar
        self._loop.admit(requests, hold=self._state is not S.RUNNING)
        return RequestStream(requests, receive, lambda r: self._loop.finish(r, "abort"))

    async def prepare_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` off the event loop, into the cache that
        ``generate`` reads; a no-op without a constraint or before the engine started.

        A large schema can take tens of milliseconds to compile, and the first constraint
        also builds the compiler (about a second for a 50k vocabulary): a server calls this
        before ``generate`` so that admission never holds the event loop that long. Raises
        ``InvalidRequestError`` for a constraint that does not compile, as ``generate`` would.
        """
        grammars = self._grammars
        if params.structured_outputs is None or grammars is None:
            return
        await anyio.to_thread.run_sync(grammars.matcher, params.structured_outputs)

    def check_admission(self) -> None:
        """Raise what ``generate`` would raise now (before any chunk); admit nothing."""
        state = self._state
        if state is S.RUNNING:
            return
        if state is S.STARTING:
            raise IllegalStateError("generate before the engine started", str(state))
        if state in (S.STOPPING, S.STOPPED):
            raise EngineStoppedError(str(state))
        if state is S.DEAD:
            raise EngineDeadError(str(self._cause)) from self._cause
        if state is S.SLEEPING and self.config.when_asleep == "reject":
            raise EngineSleepingError(self._sleeping_tags)
        if state is S.PAUSED and self._pause_mode == "abort":
            raise EnginePausedError()

    def abort(self, request_id: str) -> None:
        """End a request (all its ``n`` sequences) with ``finish_reason="abort"`` and free its
        blocks. Unknown ids: no-op."""
        for request in reversed(self._loop.group(request_id)):
            self._loop.finish(request, "abort")

    # -- control --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop stepping. ``abort``: end admitted requests; ``drain``: let them finish first;
        ``keep``: freeze them in place until ``resume()``. New requests are held until
        resume, except after ``mode="abort"``, which refuses them (``EnginePausedError``).
        """
        if mode not in ("abort", "drain", "keep"):
            raise InvalidRequestError("mode", f"must be 'abort', 'drain' or 'keep', got {mode!r}")
        async with self._control_lock:
            if self._state is S.SLEEPING:
                return
            self._require("pause", S.RUNNING, S.PAUSED)
            await self._pause_locked(mode)

    async def _pause_locked(self, mode: PauseMode) -> None:
        if self._state is S.RUNNING or mode == "abort":
            self._pause_mode = mode
        self._state = S.PAUSED
        if mode == "abort":
            self._end_all("abort")
        elif mode == "drain":
            self._draining = True
            self._loop.notify()
            try:
                await self._loop.wait_until_idle()
            finally:
                self._draining = False
        async with self._loop.between_steps():
            pass  # a step that was in flight has now returned

    async def resume(self) -> None:
        """Step again after ``pause()``; held requests start. No-op when running."""
        async with self._control_lock:
            if self._state is S.RUNNING:
                return
            self._require("resume", S.PAUSED)
            self._state = S.RUNNING
            self._pause_mode = None
            self._loop.release_held()

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Pause (``mode``), then release memory; returns once it is really released.

        Level 1 drops the KV cache and offloads the weights to host memory; level 2 drops
        both. ``mode="keep"``: admitted requests stay; their KV goes (preempted), recomputed
        from prompt + tokens so far once every tag is resident. Asleep already: releases what
        a partial wakeup made resident again, level 2 also weights level 1 had offloaded.
        """
        if level not in (1, 2):
            raise InvalidRequestError("level", f"must be 1 or 2, got {level!r}")
        if mode not in ("abort", "drain", "keep"):
            raise InvalidRequestError("mode", f"must be 'abort', 'drain' or 'keep', got {mode!r}")
        async with self._control_lock:
            if self._state is not S.SLEEPING:
                self._require("sleep", S.RUNNING, S.PAUSED)
                self._resume_state = self._state
                await self._pause_locked(mode)
            elif self._sleeping_tags == set(MEMORY_TAGS) and level == 1:
                return  # already asleep
            await self._loop.sleep(level)
            self._sleeping_tags = set(MEMORY_TAGS)
            self._state = S.SLEEPING

    async def wakeup(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Make ``tags`` resident again; serving resumes once every tag is. Awake tags: no-op."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown or not tags:
            raise InvalidRequestError("tags", f"must be a non-empty subset of {MEMORY_TAGS}")
        async with self._control_lock:
            if self._state in (S.RUNNING, S.PAUSED):
                return
            self._require("wake up", S.SLEEPING)
            for tag in MEMORY_TAGS:
                if tag in tags and tag in self._sleeping_tags:
                    await self._loop.wakeup(tag)
                    self._sleeping_tags.discard(tag)
            if not self._sleeping_tags:
                self._state = self._resume_state
                if self._state is S.RUNNING:
                    self._pause_mode = None
                    self._loop.release_held()

    async def update_weights(
        self,
        source: str | Path | Iterable[tuple[str, torch.Tensor]],
        *,
        kept_kv: KeptKV = "recompute",
    ) -> None:
        """Replace weights between two steps, atomically; ``weight_version`` increments.

        ``source``, a directory of safetensors or an iterable of ``(name, tensor)``, is a
        one-part ``weight_update()``: a bad tensor applies nothing. Requests holding KV then
        continue with the new weights: ``kept_kv="recompute"`` recomputes their KV (a greedy
        one continues as a fresh request would from its prompt and tokens so far); ``"reuse"``
        keeps the old KV (``InvalidRequestError`` once sleep released it).
        """
        async with self.weight_update(kept_kv=kept_kv) as update:
            await update.push_source(source, own="weights" not in self._sleeping_tags)

    def weight_update(self, *, kept_kv: KeptKV = "recompute") -> WeightUpdate:
        """An update pushed in parts (``WeightUpdate``); ``kept_kv`` as in update_weights."""
        if (info := self._info) is None:
            raise IllegalStateError("update weights", str(self._state))
        # an executor in another process takes the tensors from the host
        device = torch.device(info.device if isinstance(self._executor, UniExecutor) else "cpu")
        executor = self._executor
        absorber = _ExecutorAbsorber(self, executor) if isinstance(executor, AbsorbsParts) else None
        return WeightUpdate(
            info.weight_specs,
            device,
            kept_kv,
            self._updates,
            self._check_update,
            self._commit,
            absorber,
        )

    def _check_update(self, kept_kv: KeptKV) -> str:
        self._require("update weights", S.RUNNING, S.PAUSED, S.SLEEPING)
        if "weights" in self._sleeping_tags and not isinstance(self._executor, StagesWeights):
            raise EngineSleepingError(self._sleeping_tags)
        if kept_kv == "reuse" and self._state is S.SLEEPING:
            reason = "sleep released the KV cache the old weights computed; use 'recompute'"
            raise InvalidRequestError("kept_kv", reason)
        return str(self._state)

    async def _commit(
        self, named: Named, kept_kv: KeptKV, absorbed: list[str], held: set[str]
    ) -> None:
        """``held``: names whose tensors are views of a file the update holds only until
        it ends; kept for a wakeup, they are copied first."""
        async with self._control_lock:
            self._check_update(kept_kv)
            stage = "weights" in self._sleeping_tags  # _check_update: the executor stages
            if stage and held:
                named = await anyio.to_thread.run_sync(_owned, named, held)
            await self._loop.apply_weights(
                named, stage=stage, recompute=kept_kv == "recompute", absorbed=absorbed
            )

    def _require(self, action: str, *allowed: EngineState) -> None:
        if self._state not in allowed:
            raise IllegalStateError(action, str(self._state))

    # -- introspection --------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return frozenset(self._sleeping_tags)

    @property
    def weight_version(self) -> int:
        return self._loop.weight_version

    @property
    def observers(self) -> list[EngineObserver]:
        """Told of every finished request and every step (on the event loop: be quick)."""
        return self._loop.observers

    @observers.setter
    def observers(self, observers: list[EngineObserver]) -> None:
        self._loop.observers = observers

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_config(self) -> Any:
        info = self._info
        if info is None:
            raise IllegalStateError(
                "read the model config before the engine started", str(self._state)
            )
        return info.model_config

    @property
    def max_model_len(self) -> int:
        info = self._info
        return info.max_model_len if info is not None else 0

    def memory_stats(self) -> dict[str, MemoryStats]:
        """Bytes of weights and KV cache per device (and the CUDA allocator's figures)."""
        return self._loop.memory_stats()

    def stats(self) -> EngineStats:
        return self._loop.stats(str(self._state))

    @property
    def _executor(self) -> Executor:
        """The loop's executor, for tests and the bench's instrumentation; the engine
        itself reaches it only through the loop."""
        return self._loop.executor


class _LoopOwner:
    """An Engine as its loop sees it (``LoopOwner``): the gate of its state machine, and
    the death a loop failure is."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def can_step(self) -> bool:
        return self._engine._can_step()

    def loop_failed(self, cause: BaseException) -> None:
        self._engine._die(cause)


class _ExecutorAbsorber:
    """An update's parts packed by the executor as they arrive, while the weights sleep."""

    def __init__(self, engine: Engine, executor: AbsorbsParts) -> None:
        self._engine, self._executor = engine, executor

    async def absorb(self, named: Named) -> list[str]:
        if "weights" not in self._engine.sleeping_tags:
            return []
        return await self._executor.absorb_part(named)

    async def drop(self) -> None:
        await self._executor.drop_absorbed()


def _owned(named: Named, held: set[str]) -> Named:
    """``named`` with the tensors of ``held`` names copied (blocking)."""
    return [(name, t.clone() if name in held else t) for name, t in named]
