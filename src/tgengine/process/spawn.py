"""Start a tgengine child process with one end of a socket pair as its channel.

The child runs ``python -m MODULE --fd N --backend B``: ``N`` is its end of the socket,
``B`` the event loop the parent runs on (the child runs the same). Used for the engine
process (``process.child``) and for the ``mp`` executor's workers.
"""

from __future__ import annotations

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


def current_backend() -> str:
    return "trio" if sniffio.current_async_library() == "trio" else "asyncio"
