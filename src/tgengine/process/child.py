"""The engine process's entry point: ``python -m tgengine.process.child --fd N``.

The parent passes one end of a socket pair as file descriptor ``N`` and sends ``Setup``
on it first. Exit status: 0 after a clean stop, 1 when the engine died (the parent got
the cause), 2 for a broken start (bad arguments, no ``Setup``), 3 from the orphan
watchdog. SIGINT and SIGTERM are ignored: the parent decides when the engine stops.
"""

from __future__ import annotations

import os
import socket
import sys

import anyio
from anyio.abc import UNIXSocketStream

from ..engine.engine import Engine
from ..ipc.spawn import child_args
from ..ipc.wire import Channel
from ..runtime.gc_heap import freeze_startup_heap
from .host import EngineHost
from .messages import Setup


async def serve_parent(sock: socket.socket) -> BaseException | None:
    """Run the engine the parent describes in its ``Setup``; return its fault, if any."""
    channel = Channel(await UNIXSocketStream.from_socket(sock))
    try:
        try:
            setup, *rest = await channel.receive()
        except anyio.EndOfStream:
            return None  # the parent left before it said anything
        if not isinstance(setup, Setup) or rest:
            raise TypeError(f"expected Setup alone first, got {type(setup).__name__}")
        factory = setup.executor_factory
        engine = Engine(setup.config, executor=factory(setup.config) if factory else None)
        # this process is the engine's alone: start-up's objects are frozen once it serves
        return await EngineHost(engine, channel, on_ready=freeze_startup_heap).run()
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()


def main(argv: list[str] | None = None) -> int:
    sock, backend = child_args("python -m tgengine.process.child", argv)
    cause = anyio.run(serve_parent, sock, backend=backend)
    return 1 if cause is not None else 0


if __name__ == "__main__":
    status = main()
    # Skip the interpreter's teardown: torch's can take seconds on a busy machine (the
    # parent waits for the exit status, an orphan must be gone in 5 s), and the engine
    # has released everything already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
