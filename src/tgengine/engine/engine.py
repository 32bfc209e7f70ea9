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

from .._faults import FaultInjector
from ..agent.agent import MemoryStats
from ..config import EngineConfig
from ..core.scheduler import Scheduler
from ..errors import (
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
)
from ..executor import make_executor
from ..models import iter_safetensors
from ..outputs import FinishReason, RequestOutput
from ..runtime.groups import root_cause
from ..sampling import SamplingParams
from ..state import MEMORY_TAGS, EngineState
from ..stats import Counters, EngineStats
from ..structured_outputs.grammars import Grammars
from ..tokenization.tokenizer import load_tokenizer
from .admission import check_token_ids, encode_prompt
from .loop import EngineLoop
from .request_stats import EngineObserver, request_stats
from .requests import Request, RequestTracker, new_requests
from .stream import RequestStream

PauseMode = Literal["abort", "drain", "keep"]
S = EngineState


class Engine:
    """An inference engine whose lifecycle is one ``run()`` in your task group.

    ``await tg.start(engine.run)`` loads the model and returns once it can serve;
    ``engine.stop()`` (or cancelling that task group) ends it. See DESIGN.md §2.
    """

    def __init__(self, config: EngineConfig, *, _faults: FaultInjector | None = None) -> None:
        self.config = config
        self._executor = make_executor(config, _faults)
        self._loop = EngineLoop(
            config, self._executor, self._can_step, lambda: self._weight_version, self._die
        )
        self._state = S.STARTING
        self._run_called = False
        self._sleeping_tags: set[str] = set()
        self._resume_state = S.RUNNING
        self._pause_mode: PauseMode | None = None
        self._draining = False
        self._held: list[Request] = []
        self._weight_version = 0
        self._tokenizer: Any = None
        self._grammars: Grammars | None = None  # once the tokenizer and the model are known
        self._control_lock = anyio.Lock()
        self._stop_event = anyio.Event()
        self._stop_grace = 0.0
        self._cause: BaseException | None = None
        self._ids = itertools.count()
        self._counters = Counters()
        self.observers: list[EngineObserver] = []  # told of finished requests and steps

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
                await anyio.to_thread.run_sync(self._loop.executor.prepare)
                tokenizer_loaded = anyio.Event()
                tg.start_soon(self._load_tokenizer, tokenizer_loaded)
                await tg.start(self._loop.run)
                await tokenizer_loaded.wait()
                mc = self.model_config
                self._grammars = Grammars(self._tokenizer, mc.vocab_size, mc.eos_token_ids)
                self._attach_hooks()
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
        for request in list(self._held):
            self._finish(request, "abort")
        self._stop_event.set()
        self._loop.notify()

    def _die(self, cause: BaseException) -> None:
        if self._state is S.DEAD:
            return
        self._state = S.DEAD
        self._cause = cause
        self._end_all("error", error=f"engine died: {type(cause).__name__}: {cause}")

    def _end_all(self, reason: FinishReason, error: str | None = None) -> None:
        tracker = self._loop.tracker
        for request in list(tracker.requests.values()) if tracker else []:
            self._finish(request, reason, error=error)
        self._held.clear()

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
        self._check_admission()
        tracker = self._loop.tracker
        assert tracker is not None
        vocab_size = self.model_config.vocab_size
        token_ids = encode_prompt(self._tokenizer, prompt, vocab_size, self.max_model_len)
        check_token_ids(params, vocab_size)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif tracker.is_in_use(request_id):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        assert self._grammars is not None
        grammar = self._grammars.matcher(params.structured_outputs)
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        requests = new_requests(request_id, token_ids, params, self._tokenizer, send)
        if any(tracker.is_in_use(r.request_id) for r in requests):
            receive.close()
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        for request in requests:
            if request.index > 0:
                grammar = self._grammars.matcher(params.structured_outputs)
            request.grammar = grammar
            tracker.add(request)
        self._counters.prompt_tokens += len(token_ids)
        if self._state is S.RUNNING:
            for request in requests:
                self._scheduler.add(request.seq)
            self._loop.notify()
        else:
            self._held.extend(requests)
        return RequestStream(requests, receive, lambda r: self._finish(r, "abort"))

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

    def _check_admission(self) -> None:
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
        tracker = self._loop.tracker
        for request in reversed(tracker.group(request_id)) if tracker else []:
            self._finish(request, "abort")

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        if request in self._held:
            self._held.remove(request)
        tracker = self._loop.tracker
        if tracker is not None:
            tracker.finish(request, reason, error=error, weight_version=self._weight_version)

    def _release_held(self) -> None:
        for request in self._held:
            self._scheduler.add(request.seq)
        self._held.clear()
        self._loop.notify()

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
        async with self._loop.step_lock:
            pass  # a step that was in flight has now returned

    async def resume(self) -> None:
        """Step again after ``pause()``; held requests start. No-op when running."""
        async with self._control_lock:
            if self._state is S.RUNNING:
                return
            self._require("resume", S.PAUSED)
            self._state = S.RUNNING
            self._pause_mode = None
            self._release_held()

    async def sleep(self, level: int = 1, mode: Literal["abort", "drain"] = "abort") -> None:
        """Pause (``mode``), then release memory; returns once it is really released.

        Level 1 drops the KV cache and offloads the weights to host memory; level 2 drops
        both. Asleep already: releases what a partial wakeup made resident again, and
        level 2 also drops weights that level 1 had offloaded; otherwise a no-op.
        """
        if level not in (1, 2):
            raise InvalidRequestError("level", f"must be 1 or 2, got {level!r}")
        if mode not in ("abort", "drain"):
            raise InvalidRequestError("mode", f"must be 'abort' or 'drain', got {mode!r}")
        async with self._control_lock:
            if self._state is not S.SLEEPING:
                self._require("sleep", S.RUNNING, S.PAUSED)
                self._resume_state = self._state
                await self._pause_locked(mode)
            elif self._sleeping_tags == set(MEMORY_TAGS) and level == 1:
                return  # already asleep
            async with self._loop.step_lock:
                await self._executor.sleep(level)
                self._scheduler.reset_cache(self._scheduler.block_manager.num_blocks)
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
                    async with self._loop.step_lock:
                        if await self._executor.wakeup(tag):
                            self._weight_version += 1  # reloaded from the model directory
                    self._sleeping_tags.discard(tag)
            if not self._sleeping_tags:
                self._state = self._resume_state
                if self._state is S.RUNNING:
                    self._pause_mode = None
                    self._release_held()

    async def update_weights(self, source: str | Path | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights between two steps, atomically; ``weight_version`` increments.

        ``source`` is a directory of safetensors or an iterable of ``(name, tensor)``.
        Unknown names, wrong shapes or dtypes raise ``InvalidRequestError`` and nothing
        is applied. Cached prefixes computed with the old weights are dropped.
        """
        async with self._control_lock:
            self._require("update weights", S.RUNNING, S.PAUSED, S.SLEEPING)
            if "weights" in self._sleeping_tags:
                raise EngineSleepingError(self._sleeping_tags)
            if isinstance(source, (str, Path)):
                named = await anyio.to_thread.run_sync(_read_dir, str(source))
            else:
                named = list(source)
            async with self._loop.step_lock:
                await self._executor.update_weights(named)
                self._weight_version += 1
                self._scheduler.block_manager.forget_prefixes()

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
        return self._weight_version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_config(self) -> Any:
        info = self._loop.info
        if info is None:
            raise IllegalStateError(
                "read the model config before the engine started", str(self._state)
            )
        return info.model_config

    @property
    def max_model_len(self) -> int:
        info = self._loop.info
        return info.max_model_len if info is not None else 0

    def memory_stats(self) -> dict[str, MemoryStats]:
        """Bytes of weights and KV cache per device (and the CUDA allocator's figures)."""
        return self._executor.memory_stats()

    def stats(self) -> EngineStats:
        scheduler = self._loop.scheduler
        blocks = scheduler.block_manager if scheduler else None
        c = self._counters
        return EngineStats(
            state=str(self._state),
            num_running=scheduler.num_running if scheduler else 0,
            num_waiting=(scheduler.num_waiting if scheduler else 0) + len(self._held),
            num_free_blocks=blocks.num_free_blocks if blocks else 0,
            num_total_blocks=blocks.num_blocks if blocks else 0,
            kv_cache_usage=blocks.usage if blocks else 0.0,
            weight_version=self._weight_version,
            num_steps=self._loop.num_steps,
            last_step_time=self._loop.last_step_time,
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            num_preemptions_total=self._loop.num_preemptions,
            finished_total=dict(c.finished),
            prefix_cache_queries_total=blocks.num_queried_tokens if blocks else 0,
            prefix_cache_hits_total=blocks.num_hit_tokens if blocks else 0,
        )

    @property
    def _scheduler(self) -> Scheduler:
        scheduler = self._loop.scheduler
        assert scheduler is not None, "the engine loop has started"
        return scheduler

    def _attach_hooks(self) -> None:
        tracker: RequestTracker | None = self._loop.tracker
        assert tracker is not None
        counters = self._counters

        def on_token(request: Request, now: float) -> None:
            counters.generation_tokens += 1

        def on_finish(request: Request) -> None:
            counters.finished[request.finish_reason or "abort"] += 1

        def on_request_done(members: list[Request]) -> None:
            stats = request_stats(members)
            for observer in self.observers:
                observer.request_finished(stats)

        def on_step(num_batched_tokens: int) -> None:
            for observer in self.observers:
                observer.step_finished(num_batched_tokens)

        tracker.token_hooks.append(on_token)
        tracker.finish_hooks.append(on_finish)
        tracker.group_hooks.append(on_request_done)
        self._loop.step_hooks.append(on_step)


def _read_dir(path: str) -> list[tuple[str, torch.Tensor]]:
    return list(iter_safetensors(path))
