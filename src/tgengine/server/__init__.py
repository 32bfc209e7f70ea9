"""The OpenAI-compatible HTTP server: ``Server(engine, ServerConfig(...)).run`` in your task group.

::

    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        host, port = await tg.start(Server(engine, ServerConfig(port=0)).run)

See docs/server.md for the endpoints, status codes, management routes and metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ServerConfig

if TYPE_CHECKING:
    from .app import create_app
    from .server import Server

__all__ = ["Server", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # FastAPI and the routes load on first use, so that ``python -m tgengine generate``
    # (whose parser reads ServerConfig's defaults) does not pay for them at start-up.
    if name == "Server":
        from .server import Server

        return Server
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
