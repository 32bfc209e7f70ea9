"""Pure ASGI middleware: API-key checks and the request body limit.

Both answer on their own (401 / 413 with an OpenAI error body) before the app sees the
request, so no route can forget them.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

DRAIN_BYTES = 64 * 1024 * 1024


class AuthMiddleware:
    """Require ``Authorization: Bearer <key>``.

    Paths in ``admin_paths``, or under one of ``admin_prefixes``, accept only
    ``admin_key``. Paths in ``open_paths`` need no key. Every other path accepts
    ``api_key`` (or ``admin_key``) when ``api_key`` is set, and is open otherwise.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        admin_key: str | None,
        admin_paths: Collection[str],
        admin_prefixes: Collection[str] = (),
        open_paths: Collection[str] = (),
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key
        self.admin_paths = frozenset(admin_paths)
        self.admin_prefixes = tuple(admin_prefixes)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        path = scope["path"]
        is_admin = path in self.admin_paths or path.startswith(self.admin_prefixes)
        if self.admin_key is not None and is_admin:
            allowed: tuple[str | None, ...] = (self.admin_key,)
        elif path in self.open_paths:
            allowed = ()
        elif self.api_key is not None:
            allowed = (self.api_key, self.admin_key)
        else:
            allowed = ()
        if allowed and not any(_same(token, key) for key in allowed):
            error = APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.send(send)
            return
        await self.app(scope, receive, send)


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _same(token: str | None, key: str | None) -> bool:
    if token is None or key is None:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


class BodyLimitMiddleware:
    """Read the whole body first; over ``max_bytes`` → 413 without calling the app.

    The app then gets the body as one message, and later ``receive()`` calls go to the
    server (so the app still hears ``http.disconnect``). Paths for which ``streamed(path)``
    is true pass as they come: their route reads, and bounds, the body itself.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        streamed: Callable[[str], bool] = lambda path: False,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streamed = streamed
        self._drain_bytes = max(DRAIN_BYTES, 2 * max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.streamed(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(receive, send, drain=declared <= self._drain_bytes)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            more_body = message.get("more_body", False)
            if size > self.max_bytes:
                await self._reject(receive, send, drain=more_body)
                return
            chunks.append(chunk)
            if not more_body:
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, receive: Receive, send: Send, *, drain: bool) -> None:
        """413. Read (and drop) what the client still sends first, up to a bound, so that a
        client that writes its whole body before reading sees the answer, not a reset."""
        received = 0
        while drain and received <= self._drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        text = f"request body is larger than the limit of {self.max_bytes} bytes"
        await APIError(413, text, code="request_too_large").send(send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
