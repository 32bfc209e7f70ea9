"""``Server``: Hypercorn serving the app, as one more component with one ``run()``."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.abc
import sniffio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.utils import wrap_app

from ..engine.client import EngineClient
from .app import create_app
from .config import ServerConfig
from .weight_uploads import WeightUploads

log = logging.getLogger(__name__)
SHUTDOWN_MARGIN = 2.0  # seconds beyond Hypercorn's own graceful timeout
# Hypercorn reads at most 64 KiB from a socket at a time (MAX_RECV, a module constant, read
# at each call); each read costs a timeout wrapper and an ASGI message. A weight part of
# hundreds of MiB then spends more time in that overhead than in moving its bytes.
READ_BYTES = 1 << 20


class Server:
    """Serves ``engine`` over HTTP on Hypercorn's worker for the running backend.

    ``run()`` is nested beside ``Engine.run`` in one task group::

        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            host, port = await tg.start(server.run)
    """

    def __init__(self, engine: EngineClient, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.address: tuple[str, int] | None = None
        self.weight_uploads: WeightUploads | None = None  # while it runs: updates over HTTP

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self.address is None:
            raise RuntimeError("the server has not started")
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind, serve, and pass the bound ``(host, port)`` to ``started()``.

        Returns only when cancelled. Cancellation is a graceful shutdown: the socket
        stops accepting, in-flight responses get ``graceful_timeout`` seconds to finish
        (a stream whose request the engine ended writes its last chunk and ``[DONE]``),
        then the rest are closed.
        """
        fastapi_app = create_app(self.engine, self.config)
        app = wrap_app(fastapi_app, 0, "asgi")  # type: ignore[arg-type]
        self.weight_uploads = fastapi_app.state.uploads
        config = self._hypercorn_config()
        sockets = config.create_sockets()
        try:
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
            host, port = sockets.insecure_sockets[0].getsockname()[:2]
            shutdown = anyio.Event()
            async with anyio.create_task_group() as tg:
                await tg.start(fastapi_app.state.uploads.run)  # weight updates over HTTP
                tg.start_soon(self._serve, app, config, sockets, shutdown)
                self.address = (host, port)
                task_status.started((host, port))
                try:
                    await anyio.sleep_forever()
                finally:
                    shutdown.set()
        finally:
            self.address = None
            for sock in sockets.insecure_sockets:
                sock.close()

    async def _serve(
        self, app: Any, config: HypercornConfig, sockets: Sockets, shutdown: anyio.Event
    ) -> None:
        # Shielded: Hypercorn shuts down gracefully when the trigger returns, and must not
        # be cancelled halfway (its asyncio worker would leave connection tasks behind).
        with anyio.CancelScope(shield=True) as scope:

            async def trigger() -> None:
                await shutdown.wait()
                scope.deadline = anyio.current_time() + config.graceful_timeout + SHUTDOWN_MARGIN

            if sniffio.current_async_library() == "trio":
                from hypercorn.trio import tcp_server as trio_tcp
                from hypercorn.trio.run import worker_serve as trio_serve

                trio_tcp.MAX_RECV = max(trio_tcp.MAX_RECV, READ_BYTES)

                await trio_serve(app, config, sockets=sockets, shutdown_trigger=trigger)
            else:
                from hypercorn.asyncio import tcp_server as asyncio_tcp
                from hypercorn.asyncio.run import worker_serve as asyncio_serve

                asyncio_tcp.MAX_RECV = max(asyncio_tcp.MAX_RECV, READ_BYTES)

                await asyncio_serve(app, config, sockets=sockets, shutdown_trigger=trigger)
        if not shutdown.is_set():
            raise RuntimeError("Hypercorn stopped serving on its own")

    def _hypercorn_config(self) -> HypercornConfig:
        cfg = self.config
        config = HypercornConfig()
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        config.bind = [f"{host}:{cfg.port}"]
        config.graceful_timeout = cfg.graceful_timeout
        config.keep_alive_timeout = cfg.keep_alive_timeout
        config.backlog = cfg.backlog
        config.accesslog = None
        config.errorlog = logging.getLogger("tgengine.server.hypercorn")
        return config
