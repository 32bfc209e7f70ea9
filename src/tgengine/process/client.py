"""``ProcessEngine``: ``Engine``'s public API, with the engine's ``run()`` in a child process.

The child (``python -m tgengine.process.child``) runs the real ``Engine``; this parent
tokenizes, admits, and streams chunks over a socket pair. Synchronous calls (``generate``
admission, ``state``, ``stats()``, ``memory_stats()``) answer from the latest ``Snapshot``
the child sent; control calls are remote calls that raise the child's exception.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from ..agent.agent import MemoryStats
from ..config import EngineConfig
from ..engine.request_stats import EngineObserver
from ..engine.weight_update import KeptKV
from ..errors import (
    EngineDeadError,
    EngineProcessExited,
    EngineStoppedError,
    IllegalStateError,
    describe_status,
)
from ..executor import Executor
from ..ipc.calls import CallTracker, Reply
from ..ipc.spawn import spawn_child
from ..ipc.weights_file import remove_weights_dir, write_weights_dir
from ..ipc.wire import Channel
from ..runtime.groups import root_cause
from ..sampling import SamplingParams
from ..state import MEMORY_TAGS, EngineState
from ..stats import EngineStats
from ..tokenization.tokenizer import load_tokenizer
from .admission import Admission
from .connection import Connection
from .messages import (
    ControlCommand,
    Final,
    Output,
    Pause,
    Ready,
    Refused,
    RequestFinished,
    Resume,
    Setup,
    Sleep,
    Snapshot,
    StepFinished,
    Stop,
    UpdateWeights,
    Wakeup,
)
from .remote_requests import RemoteRequests
from .remote_stream import RemoteStream
from .remote_update import RemoteWeightUpdate

if TYPE_CHECKING:
    import torch

S = EngineState


class ProcessEngine:
    """An ``Engine`` in its own process, behind the same API (``EngineClient``).

    ``await tg.start(client.run)`` starts the engine process and returns once it can
    serve; ``stop(grace)`` or cancelling ends it (the process gets ``shutdown_timeout``
    seconds to exit before it is killed). If the process dies — killed, crashed, or a fault
    inside its engine — every admitted request ends with its ``"error"`` chunk and
    ``run()`` raises ``EngineDeadError``; its ``__cause__`` is the engine's exception, or
    ``EngineProcessExited`` with the exit status. The child exits by itself within a few
    seconds of this process dying. ``executor_factory`` (picklable: it crosses to the
    child) builds the child engine's executor, as ``Engine``'s ``executor`` argument.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        shutdown_timeout: float = 10.0,
        executor_factory: Callable[[EngineConfig], Executor] | None = None,
    ) -> None:
        self.config = config
        self.shutdown_timeout = shutdown_timeout
        self.pid: int | None = None
        self._executor_factory = executor_factory
        self._state = S.STARTING
        self._run_called = False
        self._stopping = False
        self._cause: BaseException | None = None
        self._admission: Admission | None = None  # once the engine process serves
        self.observers: list[EngineObserver] = []  # told of the engine process's requests, steps
        self._ready: Ready | None = None
        self._final: Final | None = None
        self._snapshot: Snapshot | None = None
        self._snapshot_time = 0.0
        self._connection = Connection()
        self._send = self._connection.send
        self._requests = RemoteRequests(self._send)
        self._calls = CallTracker()  # control calls awaiting the engine process's reply
        self._update_ids = itertools.count(1)
        self._started = anyio.Event()

    # -- lifecycle ------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the engine process, serve until stopped, then return.

        ``started()`` is called once the child's engine can serve. Cancellation stops the
        child (``stop(grace=0)``) and waits for it to exit. A dead child raises
        ``EngineDeadError`` after every admitted request got its ``"error"`` chunk.
        """
        if self._run_called:
            raise IllegalStateError("run the engine twice", str(self._state))
        self._run_called = True
        try:
            process, channel = await self._spawn()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._connection.write_loop, channel)
                    tg.start_soon(
                        self._connection.read_loop,
                        channel,
                        tg.cancel_scope,
                        self._apply,
                        self._dispatch,
                    )
                    self._send(Setup(self.config, self._executor_factory))
                    tokenizer = await anyio.to_thread.run_sync(
                        load_tokenizer,
                        self.config.tokenizer or self.config.model,
                        self.config.tokenizer_mode,
                    )
                    await self._started.wait()
                    assert self._ready is not None
                    self._admission = await anyio.to_thread.run_sync(
                        Admission, tokenizer, self._ready.model_config, self._ready.max_model_len
                    )
                    task_status.started()
                    await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._reap(process, channel)
        except Exception as exc:
            cause = root_cause(exc)
            self._die(cause)
            raise EngineDeadError(f"{type(cause).__name__}: {cause}") from cause
        if self._cause is not None:
            cause = self._cause
            raise EngineDeadError(f"{type(cause).__name__}: {cause}") from cause

    async def _spawn(self) -> tuple[anyio.abc.Process, Channel]:
        process, channel = await spawn_child("tgengine.process.child")
        self.pid = process.pid
        return process, channel

    async def _reap(self, process: anyio.abc.Process, channel: Channel) -> None:
        """Make sure the child is gone, and settle the state from how it went."""
        went_by_itself = self._connection.lost.is_set()
        await channel.aclose()  # the child sees end-of-stream: it stops now (grace 0)
        final = self._final
        clean = final is not None and final.cause is None
        if went_by_itself and not clean:
            # The exit status can take a while (interpreter teardown): end every request
            # now with what is known, as Engine does before its own cleanup.
            known = final.cause if final is not None else None
            reason = f"{type(known).__name__}: {known}" if known else "its process ended"
            self._state = S.DEAD
            self._end_all("error", f"engine died: {reason}")
        with anyio.move_on_after(self.shutdown_timeout):
            await process.wait()
        if process.returncode is None:
            process.kill()
        returncode = await process.wait()
        await process.aclose()
        if not went_by_itself or (clean and returncode == 0 and self._stopping):
            self._end_all("abort")
            if self._state is not S.DEAD:
                self._state = S.STOPPED
            return
        cause: BaseException
        if self._final is not None and self._final.cause is not None:
            cause = self._final.cause
            cause.add_note(f"(engine process {self.pid} exited with {describe_status(returncode)})")
        else:
            cause = EngineProcessExited(process.pid, returncode)
        self._die(cause)

    def stop(self, grace: float = 0.0) -> None:
        """Stop admitting; let admitted requests run up to ``grace`` seconds, abort the rest.

        ``run()`` returns once the engine process has exited. Idempotent.
        """
        if self._state in (S.STOPPING, S.STOPPED, S.DEAD):
            return
        self._state = S.STOPPING
        self._stopping = True
        self._send(Stop(max(0.0, grace)))

    def _die(self, cause: BaseException) -> None:
        if self._cause is None:  # a snapshot may have said DEAD already; this says why
            self._cause = cause
        self._state = S.DEAD
        self._end_all("error", f"engine died: {type(cause).__name__}: {cause}")

    def _end_all(self, reason: Literal["abort", "error"], error: str | None = None) -> None:
        self._requests.end_all(reason, error, self.weight_version)
        state = self._state

        def call_error() -> BaseException:
            if state is S.DEAD:
                return EngineDeadError((error or "").removeprefix("engine died: "))
            return IllegalStateError("finish the call", str(state))

        self._calls.fail_all(0, call_error)

    # -- requests -------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RemoteStream:
        """Admit one request and return the stream of its chunks; as ``Engine.generate``."""
        self.check_admission()
        assert self._admission is not None
        params = params or SamplingParams()
        token_ids = self._admission.token_ids(prompt, params)
        return self._requests.admit(token_ids, params, request_id)

    async def prepare_structured_outputs(self, params: SamplingParams) -> None:
        """As ``Engine.prepare_structured_outputs``: compile the constraint off the event
        loop (here, where ``generate`` checks it; the engine process compiles its own)."""
        if self._admission is not None and params.structured_outputs is not None:
            await anyio.to_thread.run_sync(self._admission.compile, params)

    def check_admission(self) -> None:
        """Raise what ``generate`` would raise now (before any chunk); admit nothing."""
        state = self._state
        if state in (S.STOPPING, S.STOPPED):
            raise EngineStoppedError(str(state))
        if state is S.DEAD:  # a failed start included, as Engine does
            raise EngineDeadError(str(self._cause)) from self._cause
        if state is S.STARTING or self._admission is None:
            raise IllegalStateError("generate before the engine started", str(state))
        refusal = self._snapshot.refusal if self._snapshot else None
        if refusal is not None:
            raise copy.copy(refusal)

    def abort(self, request_id: str) -> None:
        """End a request with ``finish_reason="abort"`` (the chunk comes from the engine)."""
        self._requests.abort(request_id)

    # -- control --------------------------------------------------------------------

    async def pause(self, mode: Literal["abort", "drain", "keep"] = "abort") -> None:
        """As ``Engine.pause``, in the engine process."""
        await self._call("pause", Pause(mode))

    async def resume(self) -> None:
        """As ``Engine.resume``, in the engine process."""
        await self._call("resume", Resume())

    async def sleep(
        self, level: int = 1, mode: Literal["abort", "drain", "keep"] = "abort"
    ) -> None:
        """As ``Engine.sleep``: returns once the engine process has released the memory."""
        await self._call("sleep", Sleep(level, mode))

    async def wakeup(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """As ``Engine.wakeup``, in the engine process."""
        await self._call("wake up", Wakeup((tags,) if isinstance(tags, str) else tuple(tags)))

    async def update_weights(
        self,
        source: str | Path | Iterable[tuple[str, torch.Tensor]],
        *,
        kept_kv: KeptKV = "recompute",
    ) -> None:
        """As ``Engine.update_weights``. Tensors travel as one safetensors file (in
        ``/dev/shm`` where it exists), written in a thread and removed afterwards."""
        if isinstance(source, (str, Path)):
            await self._call("update weights", UpdateWeights(str(source), kept_kv))
            return
        named = list(source)
        path = await anyio.to_thread.run_sync(write_weights_dir, named)
        try:
            await self._call("update weights", UpdateWeights(str(path), kept_kv))
        finally:
            remove_weights_dir(path)

    def weight_update(self, *, kept_kv: KeptKV = "recompute") -> RemoteWeightUpdate:
        """As ``Engine.weight_update()``: an update in parts, each written to shared memory
        and pushed by the engine process into its own ``weight_update()``."""
        return RemoteWeightUpdate(self._call, next(self._update_ids), kept_kv)

    async def _call(self, action: str, command: ControlCommand) -> None:
        """Send ``command`` and wait for its reply; raise the error it carries. ``action``
        names the call in an ``IllegalStateError``, as Engine's do ("cannot wake up ...").

        Cancellation stops the wait only: the call may still run in the engine process.
        """
        if self._state in (S.STARTING, S.STOPPED, S.DEAD) or self._connection.lost.is_set():
            raise IllegalStateError(action, str(self._state))
        with self._calls.open(command) as (request, call):
            self._send(request)
            await call.done.wait()
        if call.error is not None:
            raise call.error

    # -- introspection --------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        if self._snapshot is None or self._state.is_final:
            return frozenset()
        return self._snapshot.sleeping_tags

    @property
    def weight_version(self) -> int:
        return self._snapshot.weight_version if self._snapshot else 0

    @property
    def tokenizer(self) -> Any:
        return self._admission.tokenizer if self._admission else None

    @property
    def model_config(self) -> Any:
        if self._ready is None:
            raise IllegalStateError(
                "read the model config before the engine started", str(self._state)
            )
        return self._ready.model_config

    @property
    def max_model_len(self) -> int:
        return self._ready.max_model_len if self._ready else 0

    def memory_stats(self) -> dict[str, MemoryStats]:
        """The engine process's figures, as of its latest snapshot; once it is gone, it
        holds nothing (its last snapshot may predate its release of memory)."""
        memory = dict(self._snapshot.memory) if self._snapshot else {}
        if self._state in (S.STOPPED, S.DEAD):
            return {
                key: dataclasses.replace(m, weights_bytes=0, kv_cache_bytes=0, host_weights_bytes=0)
                for key, m in memory.items()
            }
        return memory

    def stats(self) -> EngineStats:
        """The engine process's stats as of its latest snapshot (at most ~0.5 s old),
        with ``last_step_time`` on this process's clock."""
        snapshot = self._snapshot
        if snapshot is None:
            return EngineStats(str(self._state), 0, 0, 0, 0, 0.0, 0, 0, None, 0, 0, 0)
        stats = snapshot.stats
        last = stats.last_step_time
        if last is not None:
            last = self._snapshot_time - (snapshot.clock - last)
        return dataclasses.replace(stats, state=str(self._state), last_step_time=last)

    # -- what the engine process sends ----------------------------------------------

    def _apply(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._snapshot_time = anyio.current_time()
        if self._ready is not None and self._state not in (S.STOPPING, S.STOPPED, S.DEAD):
            self._state = snapshot.state

    def _dispatch(self, message: Any) -> None:
        match message:
            case Output():
                self._requests.deliver(message)
            case Refused():
                self._requests.refuse(message, self.weight_version)
            case StepFinished(stats):
                for observer in self.observers:
                    observer.step_finished(stats)
            case RequestFinished(stats):
                for observer in self.observers:
                    observer.request_finished(stats)
            case Reply():
                self._calls.reply(message)
            case Ready():
                self._ready = message
                if self._snapshot is not None and self._state is S.STARTING:
                    self._state = self._snapshot.state
                self._started.set()
            case Final():
                self._final = message
