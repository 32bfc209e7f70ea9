"""A worker process of the ``mp`` executor: ``python -m tgengine.executor.mp_worker --fd N``.

The parent passes one end of a socket pair as file descriptor ``N`` and sends a
``RankSpec`` on it first; the worker answers ``Loaded`` and then one ``Reply`` per
``Request``, in order (``mp_messages``). It stops when the parent closes the socket, and
exits by itself within a few seconds of the parent dying (``ParentWatch``). Exit status:
0 after a clean stop, 1 when the rank failed (the parent got ``Fatal``), 2 for a broken
start, 3 from the orphan watchdog. SIGINT and SIGTERM are ignored: the parent decides when
ranks stop.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import anyio
import anyio.abc
from anyio.abc import UNIXSocketStream

from ..agent.agent import AgentInfo
from ..ipc.calls import Reply, Request
from ..ipc.orphan import ParentWatch
from ..ipc.portable import portable
from ..ipc.spawn import child_args
from ..ipc.wire import Channel
from ..runtime.gc_heap import freeze_startup_heap
from ..runtime.task_status import StartedOnce
from .mp_messages import Fatal, Loaded, Memory
from .worker import Execute, RankSpec, RankWorker

MEMORY_EVERY = 0.5  # seconds between memory figures sent with step replies


async def serve_parent(sock: socket.socket) -> int:
    """Run the rank the parent describes; return the exit status."""
    channel = Channel(await UNIXSocketStream.from_socket(sock))
    parent = ParentWatch()
    try:
        try:
            spec = await channel.receive()
        except anyio.EndOfStream:
            return 0  # the parent left before it said anything
        if not isinstance(spec, RankSpec):
            raise TypeError(f"expected a RankSpec first, got {type(spec).__name__}")
        return await _serve(RankWorker(spec), channel, parent)
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()


async def _serve(worker: RankWorker, channel: Channel, parent: ParentWatch) -> int:
    failed: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(parent.watch, tg.cancel_scope)
        info = await tg.start(_run_rank, worker, failed, tg.cancel_scope)
        if info is not None:
            freeze_startup_heap()  # the rank's process is its own; sleep's collection is then short
            await _send(channel, parent, Loaded(info, os.getpid(), worker.memory_stats()))
            await _obey(worker, channel, parent)
        tg.cancel_scope.cancel()
    if failed:  # loading failed, or the agent did later: the parent gets why
        await _send(channel, parent, Fatal(portable(failed[0], with_traceback=True)))
        return 1
    return 0


async def _run_rank(
    worker: RankWorker,
    failed: list[BaseException],
    scope: anyio.CancelScope,
    *,
    task_status: anyio.abc.TaskStatus[AgentInfo | None],
) -> None:
    status = StartedOnce(task_status)
    try:
        await worker.run(task_status=status)
    except Exception as exc:  # reported to the parent by _serve, as Fatal
        failed.append(exc)
        scope.cancel()
        if not status.called:
            status.started(None)


async def _obey(worker: RankWorker, channel: Channel, parent: ParentWatch) -> None:
    """Answer requests in order until the parent closes the socket."""
    memory_time = -MEMORY_EVERY
    while True:
        try:
            request: Request = await channel.receive()
        except anyio.EndOfStream:
            parent.orphaned()  # or stopped on purpose: either way, leave soon
            return
        result: object = None
        error: BaseException | None = None
        start = time.perf_counter()
        try:
            result = await worker.handle(request.command)
        except Exception as exc:  # the command's failure is the parent's to report
            error = portable(exc, with_traceback=True)
        elapsed = time.perf_counter() - start
        now = anyio.current_time()
        if not isinstance(request.command, Execute) or now - memory_time >= MEMORY_EVERY:
            memory_time = now
            await _send(channel, parent, Memory(worker.memory_stats()))
        await _send(channel, parent, Reply(request.call_id, result, error, elapsed))


async def _send(channel: Channel, parent: ParentWatch, message: object) -> None:
    if parent.is_orphaned:
        return
    try:
        await channel.send(message)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        parent.orphaned()


def main(argv: list[str] | None = None) -> int:
    sock, backend = child_args("python -m tgengine.executor.mp_worker", argv)
    return anyio.run(serve_parent, sock, backend=backend)


if __name__ == "__main__":
    status = main()
    # Skip the interpreter's teardown (torch's can take seconds); everything is released.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
