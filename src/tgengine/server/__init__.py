"""The OpenAI-compatible HTTP server: ``Server(engine, ServerConfig(...)).run`` in your task group.

::

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        host, port = await tg.start(Server(engine, ServerConfig(port=0)).run)

See docs/server.md for the endpoints, status codes, management routes and metrics.
"""

from .app import create_app
from .config import ServerConfig
from .server import Server

__all__ = ["Server", "ServerConfig", "create_app"]
