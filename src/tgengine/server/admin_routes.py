"""Management routes (only with an admin key): sleep, wake up, pause, resume, update weights.

Invalid arguments are a 400 and change nothing. A call the engine's state does not allow
is a 409 (``illegal_state``), or a 503 with Retry-After once it is stopping or dead.
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query

from ..errors import EngineSleepingError, IllegalStateError
from ..state import MEMORY_TAGS, EngineState
from .context import ServerContext
from .errors import APIError, invalid, unavailable
from .protocol import EngineStateResponse, ErrorResponse, IsSleepingResponse, UpdateWeightsRequest

ADMIN_PATHS = ("/sleep", "/wakeup", "/is_sleeping", "/pause", "/resume", "/update_weights")
GONE = (EngineState.STOPPING, EngineState.STOPPED, EngineState.DEAD)

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid argument; nothing changed."},
    401: {"model": ErrorResponse, "description": "Missing or incorrect admin key."},
    409: {"model": ErrorResponse, "description": "Not allowed in the engine's current state."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    503: {"model": ErrorResponse, "description": "The engine is stopping or dead."},
}


def admin_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(tags=["management"])
    engine = ctx.engine

    async def control(call: Awaitable[None]) -> EngineStateResponse:
        try:
            await call
        except (IllegalStateError, EngineSleepingError) as exc:
            if engine.state in GONE:
                code = "engine_dead" if engine.state is EngineState.DEAD else "engine_stopped"
                raise unavailable(str(exc), code, ctx.config.retry_after_seconds) from exc
            raise APIError(409, str(exc), type="conflict_error", code="illegal_state") from exc
        return _state(ctx)

    @router.post("/sleep", response_model=EngineStateResponse, responses=_errors(400, 409, 503))
    async def sleep(
        level: Annotated[
            int, Query(ge=1, le=2, description="1: offload weights; 2: drop them.")
        ] = 1,
        mode: Annotated[Literal["abort", "drain", "keep"], Query()] = "abort",
    ) -> EngineStateResponse:
        """Pause (aborting, draining or keeping requests), then release memory; returns once
        it is free. ``keep``: admitted requests stay, recomputed once every tag is resident."""
        return await control(engine.sleep(level, mode))

    @router.post("/wakeup", response_model=EngineStateResponse, responses=_errors(400, 409, 503))
    async def wakeup(
        tags: Annotated[
            list[Literal["weights", "kv_cache"]] | None,
            Query(description="Memory to make resident (repeatable); default: all."),
        ] = None,
    ) -> EngineStateResponse:
        """Make the tagged memory resident; serving resumes once every tag is."""
        return await control(engine.wakeup(tuple(tags) if tags else MEMORY_TAGS))

    @router.get("/is_sleeping", response_model=IsSleepingResponse, responses=_errors())
    async def is_sleeping() -> IsSleepingResponse:
        return IsSleepingResponse(is_sleeping=engine.is_sleeping)

    @router.post("/pause", response_model=EngineStateResponse, responses=_errors(400, 409, 503))
    async def pause(
        mode: Literal["abort", "drain", "keep"] = Query("abort"),
    ) -> EngineStateResponse:
        """Stop stepping: abort, drain or keep the admitted requests."""
        return await control(engine.pause(mode))

    @router.post("/resume", response_model=EngineStateResponse, responses=_errors(409, 503))
    async def resume() -> EngineStateResponse:
        return await control(engine.resume())

    @router.post(
        "/update_weights", response_model=EngineStateResponse, responses=_errors(400, 409, 413, 503)
    )
    async def update_weights(body: UpdateWeightsRequest) -> EngineStateResponse:
        """Load new weights from a server-side directory of safetensors, between two steps."""
        if not await anyio.to_thread.run_sync(_is_dir, body.path):
            raise invalid("path", f"path: {body.path!r} is not a directory on the server")
        return await control(engine.update_weights(body.path, kept_kv=body.kept_kv))

    return router


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: ERRORS[code] for code in (401, *codes)}


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # e.g. an embedded NUL byte
        return False


def _state(ctx: ServerContext) -> EngineStateResponse:
    engine = ctx.engine
    return EngineStateResponse(
        state=str(engine.state),
        is_sleeping=engine.is_sleeping,
        sleeping_tags=sorted(engine.sleeping_tags),
        weight_version=engine.weight_version,
    )
