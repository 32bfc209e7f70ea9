"""HTTP errors with OpenAI-shaped bodies, and how engine errors map onto them.

==========================  ======  ==========================================
cause                       status  body ``error.code``
==========================  ======  ==========================================
invalid JSON, field, value  400     ``invalid_value`` (``param`` names the field)
missing or wrong key        401     ``invalid_api_key``
unknown model / route       404     ``model_not_found`` / ``not_found``
illegal state transition    409     ``illegal_state``
body over the limit         413     ``request_too_large``
sleeping / paused(abort)    503     ``engine_sleeping`` / ``engine_paused`` + Retry-After
stopping / dead             503     ``engine_stopped`` / ``engine_dead`` + Retry-After
==========================  ======  ==========================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import Send

from ..errors import (
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineStoppedError,
    IllegalStateError,
    InvalidRequestError,
    ModelLoadError,
    TGEngineError,
)

UNAVAILABLE: dict[type[TGEngineError], str] = {
    EngineSleepingError: "engine_sleeping",
    EnginePausedError: "engine_paused",
    EngineStoppedError: "engine_stopped",
    EngineDeadError: "engine_dead",
}


class APIError(Exception):
    """An error the server answers with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send: Send) -> None:
        """Send this error as a whole response on a raw ASGI ``send``."""
        body = json.dumps(self.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def unavailable(message: str, code: str, retry_after: int) -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable_error",
        code=code,
        headers={"Retry-After": str(retry_after)},
    )


def from_engine_error(exc: TGEngineError, retry_after: int) -> APIError:
    """The HTTP error for an engine error; never a 5xx for the caller's own mistake."""
    if isinstance(exc, InvalidRequestError):
        return invalid(exc.field, str(exc))
    for cls, code in UNAVAILABLE.items():
        if isinstance(exc, cls):
            return unavailable(str(exc), code, retry_after)
    if isinstance(exc, IllegalStateError):
        return APIError(409, str(exc), type="conflict_error", code="illegal_state")
    if isinstance(exc, ModelLoadError):
        return invalid("path", str(exc))
    return APIError(500, str(exc), type="server_error", code="internal_error")


def from_validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid(None, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid(None, f"invalid JSON body: {first.get('msg', '')}")
    parts = list(first.get("loc", ()))
    keep_last = first.get("type") == "extra_forbidden"  # the last part: the client's own key
    loc = [
        str(p)
        for i, p in enumerate(parts)
        if not _is_union_tag(p) or (keep_last and i == len(parts) - 1)
    ]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return invalid(param, f"{param}: {message}{more}" if param else f"{message}{more}")


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union that failed in the error's location
    (``stop.constrained-str``, ``tool_choice.NamedToolChoice``); the field is what a client
    needs, not the member. Field names here are snake_case, so a tag never looks like one."""
    if not isinstance(part, str) or not part:
        return False
    simple = part in ("str", "int", "float", "bool", "none")
    return simple or part[0].isupper() or any(c in part for c in "[-")


def install_error_handlers(app: FastAPI, retry_after: int) -> None:
    """Answer every error with an OpenAI error body; a 500 only for a bug of ours."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, TGEngineError)
        return from_engine_error(exc, retry_after).response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_error(exc).response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return error.response()

    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}"
        return APIError(500, message, type="server_error", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(TGEngineError, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)
