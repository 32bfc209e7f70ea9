"""The engine process's entry point: ``python -m tgengine.process.child --fd N``.

The parent passes one end of a socket pair as file descriptor ``N`` and sends ``Setup``
on it first. Exit status: 0 after a clean stop, 1 when the engine died (the parent got
the cause), 2 for a broken start (bad arguments, no ``Setup``), 3 from the orphan
watchdog. SIGINT and SIGTERM are ignored: the parent decides when the engine stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

import anyio
from anyio.abc import UNIXSocketStream

from .._faults import FaultInjector
from ..engine import Engine
from .host import EngineHost
from .messages import Setup
from .wire import Channel


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
        engine = Engine(setup.config, _faults=FaultInjector.from_plan(setup.faults))
        return await EngineHost(engine, channel).run()
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgengine.process.child")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the parent")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args(argv)
    # The parent alone stops this process (a Ctrl-C reaches the whole process group; the
    # parent then drains through it); a dead parent is noticed without any signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    cause = anyio.run(serve_parent, sock, backend=args.backend)
    return 1 if cause is not None else 0


if __name__ == "__main__":
    status = main()
    # Skip the interpreter's teardown: torch's can take seconds on a busy machine (the
    # parent waits for the exit status, an orphan must be gone in 5 s), and the engine
    # has released everything already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
