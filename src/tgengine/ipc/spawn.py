"""Start a tgengine child process with one end of a socket pair as its channel.

The child runs ``python -m MODULE --fd N --backend B``: ``N`` is its end of the socket,
``B`` the event loop the parent runs on (the child runs the same). Used for the engine
process (``process.child``) and for the ``mp`` executor's workers.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys

import anyio
import anyio.abc
import sniffio
from anyio.abc import UNIXSocketStream

from .wire import Channel


async def spawn_child(module: str) -> tuple[anyio.abc.Process, Channel]:
    """The child process running ``module`` and the parent's channel to it."""
    parent, child = socket.socketpair()
    try:
        with child:
            command = [sys.executable, "-m", module]
            command += ["--fd", str(child.fileno()), "--backend", current_backend()]
            process = await anyio.open_process(
                command,
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
            )
        return process, Channel(await UNIXSocketStream.from_socket(parent))
    except BaseException:
        parent.close()
        raise


def child_args(prog: str, argv: list[str] | None = None) -> tuple[socket.socket, str]:
    """The child's side of ``spawn_child``: its socket to the parent and the parent's backend.

    The parent alone stops the child (a Ctrl-C reaches the whole process group; the parent
    then drains through it), so SIGINT and SIGTERM are ignored from here on; a dead parent
    is noticed without any signal.
    """
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--fd", type=int, required=True, help="the socket to the parent")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return socket.socket(fileno=args.fd), args.backend


def current_backend() -> str:
    return "trio" if sniffio.current_async_library() == "trio" else "asyncio"
