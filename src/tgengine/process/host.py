"""``EngineHost``: inside the engine process, runs the real ``Engine.run()`` for the parent.

It answers the parent's messages on a ``Channel`` and streams every request's chunks
back, batched: each frame carries what is ready and a fresh ``Snapshot``. The parent is
watched two ways (end of stream on the socket, and a changed parent pid); once it is
gone the engine is cancelled, and a watchdog ends the process if that takes too long.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

from ..agent.agent import MemoryStats
from ..engine.engine import Engine
from ..engine.request_stats import RequestStats, StepStats
from ..engine.stream import RequestStream
from ..errors import EngineDeadError, TGEngineError
from ..ipc.calls import Reply, Request
from ..ipc.orphan import ParentWatch
from ..ipc.portable import portable
from ..ipc.wire import Channel
from ..runtime.task_status import StartedOnce
from .hosted_update import HostedUpdates
from .messages import (
    Abort,
    ControlCommand,
    Final,
    Frame,
    Generate,
    Output,
    Pause,
    Ready,
    Refused,
    RequestFinished,
    Resume,
    Sleep,
    Snapshot,
    StepFinished,
    Stop,
    UpdateAbort,
    UpdateBegin,
    UpdateCommit,
    UpdatePart,
    UpdateWeights,
    Wakeup,
)

HEARTBEAT = 0.5  # seconds between snapshots while nothing else is sent
MAX_BATCH = 4096  # messages in one frame


class EngineHost:
    """Serves one ``Engine`` to the parent on ``channel``; ``run()`` returns when it ends.

    ``run()`` returns the engine's fault (or None after a clean stop), after the parent
    was sent every chunk and the ``Final`` message.
    """

    def __init__(
        self, engine: Engine, channel: Channel, on_ready: Callable[[], object] | None = None
    ) -> None:
        self.engine = engine
        self.channel = channel
        self._on_ready = on_ready  # called once the engine serves, before the parent hears
        self._outbox, self._outgoing = anyio.create_memory_object_stream[Any](math.inf)
        self._parent = ParentWatch()
        self._cause: BaseException | None = None
        self._memory: dict[str, MemoryStats] | None = None
        self._memory_time = 0.0
        self._updates = HostedUpdates(engine)  # the parent's weight_update(), if one is open
        engine.observers.append(self)  # the parent's observers hear what this engine does

    def request_finished(self, stats: RequestStats) -> None:
        self._send(RequestFinished(stats))

    def step_finished(self, stats: StepStats) -> None:
        self._send(StepFinished(stats))

    async def run(self) -> BaseException | None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_loop)
            try:
                async with anyio.create_task_group() as forwarders:
                    async with anyio.create_task_group() as control:
                        control.start_soon(self._parent.watch, control.cancel_scope)
                        await control.start(self._run_engine, control.cancel_scope)
                        if self._cause is None:
                            if self._on_ready is not None:
                                self._on_ready()
                            model = self.engine.model_config
                            self._send(Ready(model, self.engine.max_model_len, os.getpid()))
                            control.start_soon(self._read_loop, forwarders, control)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._updates.close()  # an update left open applies nothing
                self._send(Final(portable(self._cause) if self._cause else None))
                self._outbox.close()
        return self._cause

    async def _run_engine(
        self, done: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        status = StartedOnce(task_status)
        try:
            await self.engine.run(task_status=status)
        except EngineDeadError as exc:
            self._cause = exc.__cause__ or exc
            if not status.called:
                task_status.started()  # died starting: run() reports it, not start()
        finally:
            done.cancel()  # the engine has ended: stop reading and watching

    async def _read_loop(
        self, forwarders: anyio.abc.TaskGroup, control: anyio.abc.TaskGroup
    ) -> None:
        while True:
            try:
                batch: list[Any] = await self.channel.receive()
            except anyio.EndOfStream:
                self._parent.orphaned()
                control.cancel_scope.cancel()  # cancelling the engine is stop(grace=0)
                return
            for message in batch:
                match message:
                    case Generate():
                        self._generate(message, forwarders)
                    case Abort(request_id):
                        self.engine.abort(request_id)
                    case Request():
                        control.start_soon(self._call, message)
                    case Stop(grace):
                        self.engine.stop(grace)

    def _generate(self, message: Generate, forwarders: anyio.abc.TaskGroup) -> None:
        try:
            stream = self.engine.generate(
                message.token_ids, message.params, request_id=message.request_id
            )
        except TGEngineError as exc:
            self._send(Refused(message.key, portable(exc)))
            return
        forwarders.start_soon(self._forward, message.key, stream)

    async def _forward(self, key: int, stream: RequestStream) -> None:
        async with stream:
            async for chunk in stream:
                self._send(Output(key, chunk))

    async def _call(self, request: Request) -> None:
        error: BaseException | None = None
        try:
            await self._control(request.command)
        except Exception as exc:  # the caller's error, raised in the parent
            error = portable(exc)
        self._send(Reply(request.call_id, error=error))

    async def _control(self, command: ControlCommand) -> None:
        engine = self.engine
        match command:
            case Pause(mode):
                await engine.pause(mode)
            case Resume():
                await engine.resume()
            case Sleep(level, mode):
                await engine.sleep(level, mode)
            case Wakeup(tags):
                await engine.wakeup(tags)
            case UpdateWeights(source, kept_kv):
                await engine.update_weights(source, kept_kv=kept_kv)
            case UpdateBegin() | UpdatePart() | UpdateCommit() | UpdateAbort():
                await self._updates.handle(command)
            case _:
                raise TypeError(f"not a control command: {type(command).__name__}")

    def _send(self, message: Any) -> None:
        self._outbox.send_nowait(message)

    async def _write_loop(self) -> None:
        """Sends batched frames until the outbox closes; returns only then."""
        async with self._outgoing:
            while True:
                messages: list[Any] = []
                with anyio.move_on_after(HEARTBEAT):
                    try:
                        messages.append(await self._outgoing.receive())
                    except anyio.EndOfStream:
                        return
                while len(messages) < MAX_BATCH:
                    try:
                        messages.append(self._outgoing.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                await self._write(Frame(messages, self._snapshot(messages)))

    async def _write(self, frame: Frame) -> None:
        if self._parent.is_orphaned:
            return  # nobody is listening
        try:
            await self.channel.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self._parent.orphaned()

    def _snapshot(self, messages: list[Any]) -> Snapshot:
        engine = self.engine
        now = anyio.current_time()
        # memory_stats() reads /proc: at most once per heartbeat, and once the engine is
        # ready and after every control call (they are what change memory), not with every
        # step's chunks.
        if (
            self._memory is None
            or now - self._memory_time >= HEARTBEAT
            or any(isinstance(m, (Ready, Reply)) for m in messages)
        ):
            self._memory, self._memory_time = engine.memory_stats(), now
        try:
            engine.check_admission()  # the parent admits on the engine's terms
            refusal = None
        except TGEngineError as exc:
            refusal = portable(exc)
        return Snapshot(
            state=engine.state,
            sleeping_tags=engine.sleeping_tags,
            weight_version=engine.weight_version,
            stats=engine.stats(),
            memory=self._memory,
            refusal=refusal,
            clock=now,
        )
