"""Weight updates in parts over HTTP (admin key): begin, send parts, commit or abort.

``POST /weights/updates`` opens one (409 while another is open) and answers its ``id``;
each ``POST /weights/updates/{id}/parts`` carries one part as a safetensors body, streamed
into a file in shared memory (the engine, or its process, maps it from there); ``POST
/weights/updates/{id}/commit`` applies every part at once; ``DELETE /weights/updates/{id}``
drops it. A bad part is a 400 naming the tensor and leaves the update open, without that
part. An update abandoned (its client disconnected while sending a part, or no part for
``weight_update_timeout`` seconds) is aborted: nothing of it applies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from ..ipc.weights_file import FILE_NAME, new_weights_dir, remove_weights_dir, write_all
from .context import ServerContext
from .errors import APIError, unavailable
from .protocol import ErrorResponse
from .weight_uploads import Upload, UploadsStopped, WeightUploads

PREFIX = "/weights/updates"
FLUSH_BYTES = 16 * 1024 * 1024  # a part's body is written out in pieces of about this size
DRAIN_BYTES = 64 * 1024 * 1024  # what is read of a part over the limit before answering 413

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A bad part (named); the update stays open."},
    401: {"model": ErrorResponse, "description": "Missing or incorrect admin key."},
    404: {"model": ErrorResponse, "description": "No such update."},
    409: {"model": ErrorResponse, "description": "Another update is open, or this one ended."},
    413: {"model": ErrorResponse, "description": "Part larger than --max-weight-part-bytes."},
    503: {"model": ErrorResponse, "description": "The engine is stopping, dead or restarting."},
}


class WeightUpdateResponse(BaseModel):
    id: str
    state: Literal["open", "committed", "aborted"]
    reason: str | None = None  # why it was aborted
    kept_kv: str
    num_parts: int
    num_bytes: int
    weight_version: int  # the engine's, as of this answer
    timeout_seconds: float  # an open update without a part for this long is aborted


def is_part_path(path: str) -> bool:
    """A part upload: its body is streamed, not held under the body limit."""
    return path.startswith(PREFIX + "/") and path.endswith("/parts")


def weight_router(ctx: ServerContext, uploads: WeightUploads) -> APIRouter:
    router = APIRouter(tags=["management"])
    limit = ctx.config.max_weight_part_bytes

    def answer(upload: Upload) -> WeightUpdateResponse:
        return WeightUpdateResponse(
            id=upload.id,
            state=upload.state,
            reason=upload.reason,
            kept_kv=upload.kept_kv,
            num_parts=upload.num_parts,
            num_bytes=upload.num_bytes,
            weight_version=ctx.engine.weight_version,
            timeout_seconds=uploads.timeout,
        )

    @router.post(
        PREFIX,
        status_code=201,
        response_model=WeightUpdateResponse,
        responses=_errors(400, 409, 503),
    )
    async def begin(
        kept_kv: Annotated[Literal["recompute", "reuse"], Query()] = "recompute",
    ) -> WeightUpdateResponse:
        """Open an update in parts; its ``id`` names it in the calls that follow."""
        try:
            upload = await uploads.begin(kept_kv)
        except UploadsStopped as exc:
            raise unavailable(str(exc), "engine_stopped", ctx.retry_after) from exc
        return answer(upload)

    @router.get(
        f"{PREFIX}/{{update_id}}", response_model=WeightUpdateResponse, responses=_errors(404)
    )
    async def status(update_id: str) -> WeightUpdateResponse:
        return answer(uploads.get(update_id))

    @router.post(
        f"{PREFIX}/{{update_id}}/parts",
        response_model=WeightUpdateResponse,
        responses=_errors(400, 404, 409, 413, 503),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def part(update_id: str, request: Request) -> WeightUpdateResponse:
        """Check and stage one part: a safetensors file as the body (full tensors by name)."""
        upload = uploads.get(update_id)
        uploads.check_open(upload)
        with uploads.receiving(upload):
            directory = await anyio.to_thread.run_sync(new_weights_dir)
            try:
                size = await _receive(request, directory / FILE_NAME, limit, uploads, upload)
                uploads.check_open(upload)  # it may have ended while the body arrived
                await uploads.push(upload, directory / FILE_NAME, size)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(remove_weights_dir, directory)
        return answer(upload)

    @router.post(
        f"{PREFIX}/{{update_id}}/commit",
        response_model=WeightUpdateResponse,
        responses=_errors(400, 404, 409, 503),
    )
    async def commit(update_id: str) -> WeightUpdateResponse:
        """Apply every part at once, between two steps; ``weight_version`` increments."""
        upload = uploads.get(update_id)
        uploads.check_open(upload)
        await uploads.commit(upload)
        return answer(upload)

    @router.delete(
        f"{PREFIX}/{{update_id}}", response_model=WeightUpdateResponse, responses=_errors(404)
    )
    async def abort(update_id: str) -> WeightUpdateResponse:
        """Drop the update: nothing of it applies (a no-op once it ended)."""
        upload = uploads.get(update_id)
        await uploads.abort(upload, "aborted by the client")
        return answer(upload)

    return router


async def _receive(
    request: Request, file: Path, limit: int, uploads: WeightUploads, upload: Upload
) -> int:
    """Write the request's body to ``file``; its size. Over ``limit``: 413, and the update
    stays open. The client gone before the end of its body: the update is aborted."""
    fd = await anyio.to_thread.run_sync(_create, file)
    size = 0
    pending: list[bytes] = []
    pending_bytes = 0
    completed = False
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + DRAIN_BYTES:
                break
            if size > limit:
                continue  # read (and drop) a bounded rest: the client then sees the 413
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes >= FLUSH_BYTES:
                await anyio.to_thread.run_sync(_write, fd, pending)
                pending, pending_bytes = [], 0
        completed = True
        if size > limit:  # refused, not abandoned: the update stays open
            message = f"a part is larger than the limit of {limit} bytes"
            raise APIError(413, message, code="request_too_large")
        await anyio.to_thread.run_sync(_write, fd, pending)
    except ClientDisconnect as exc:
        raise APIError(400, "the client disconnected while sending a part") from exc
    finally:
        os.close(fd)
        if not completed:  # disconnected, or cancelled: an abandoned update
            with anyio.CancelScope(shield=True):
                await uploads.abort(upload, "the client disconnected while sending a part")
    return size


def _create(file: Path) -> int:
    return os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


def _write(fd: int, chunks: list[bytes]) -> None:
    for chunk in chunks:
        write_all(fd, memoryview(chunk))


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: ERRORS[code] for code in (401, *codes)}
