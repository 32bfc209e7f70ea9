"""Weight updates in parts over HTTP (admin key): begin, send parts, commit or abort.

``POST /weights/updates`` opens one (409 while another is open) and answers its ``id``;
each ``POST /weights/updates/{id}/parts`` carries one part as a safetensors body, streamed
into a file in shared memory (the engine, or its process, maps it from there); ``POST
/weights/updates/{id}/commit`` applies every part at once; ``DELETE /weights/updates/{id}``
drops it. A trainer on the same host may write a part to a file in ``/dev/shm`` itself and
``POST /weights/updates/{id}/parts/shared`` its path instead (the body never crosses the
socket; the file is read once before the answer, then it is the trainer's again). A bad
part is a 400 naming the tensor and leaves the update open, without that part. An update
abandoned (its client disconnected while sending a part, or no part for
``weight_update_timeout`` seconds) is aborted: nothing of it applies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import torch
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from ..ipc.weights_file import (
    FILE_NAME,
    SHARED_MEMORY,
    new_weights_dir,
    remove_weights_dir,
    write_all,
)
from ..runtime import huge_pages
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


class SharedPart(BaseModel):
    path: str  # a safetensors file in /dev/shm that the server's user may read
    # false: read before the answer (the file is the client's again); true: mapped and held
    # until the update ends (the client leaves it as it is until then; it may remove it)
    hold: bool = False


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
        if uploads.takes_buffers(upload):  # the engine is in this process: no file between
            with uploads.receiving(upload):
                sink = _BufferSink(request.headers.get("content-length"))
                size = await _receive(request, sink, limit, uploads, upload)
                uploads.check_open(upload)
                await uploads.push_buffer(upload, sink.body(), size)
            return answer(upload)
        with uploads.receiving(upload):
            # the file the last part went through, written over (its /dev/shm pages are
            # allocated once an update), unless another part is using it
            spare, upload.spare_dir = upload.spare_dir, None
            directory = (
                spare if spare is not None else await anyio.to_thread.run_sync(new_weights_dir)
            )
            reuse = False
            try:
                file = await anyio.to_thread.run_sync(_open, directory / FILE_NAME)
                try:
                    size = await _receive(request, _FileSink(file), limit, uploads, upload)
                    await anyio.to_thread.run_sync(os.ftruncate, file, size)
                finally:
                    os.close(file)
                uploads.check_open(upload)  # it may have ended while the body arrived
                await uploads.push(upload, directory / FILE_NAME, size)
                reuse = upload.state == "open" and upload.spare_dir is None
            finally:
                if reuse:  # the engine has read it (it reads each part into its memory)
                    upload.spare_dir = directory
                else:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(remove_weights_dir, directory)
        return answer(upload)

    @router.post(
        f"{PREFIX}/{{update_id}}/parts/shared",
        response_model=WeightUpdateResponse,
        responses=_errors(400, 404, 409, 413, 503),
    )
    async def shared_part(update_id: str, body: SharedPart) -> WeightUpdateResponse:
        """Check and stage one part that the client wrote to a safetensors file in
        ``/dev/shm`` (same host): read once before the answer; the file stays the client's
        (to write the next part over, or remove). With ``"hold": true`` the engine maps it
        instead and holds it until the commit's or the abort's answer: the client writes
        each part to a file of its own and leaves them as they are until then (removing them
        is fine); one written meanwhile fails the commit (400), and nothing applies."""
        upload = uploads.get(update_id)
        uploads.check_open(upload)
        file, size = await anyio.to_thread.run_sync(_shared_file, body.path)
        if size > limit:
            message = f"a part is larger than the limit of {limit} bytes"
            raise APIError(413, message, code="request_too_large")
        await uploads.push(upload, file, size, hold=body.hold)
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
    request: Request,
    sink: _FileSink | _BufferSink,
    limit: int,
    uploads: WeightUploads,
    upload: Upload,
) -> int:
    """Hand the request's body to ``sink``; its size. Over ``limit``: 413, and the update
    stays open. The client gone before the end of its body: the update is aborted."""
    size = 0
    completed = False
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + DRAIN_BYTES:
                break
            if size > limit:
                continue  # read (and drop) a bounded rest: the client then sees the 413
            await sink.add(chunk)
        completed = True
        if size > limit:  # refused, not abandoned: the update stays open
            message = f"a part is larger than the limit of {limit} bytes"
            raise APIError(413, message, code="request_too_large")
        await sink.finish()
    except ClientDisconnect as exc:
        raise APIError(400, "the client disconnected while sending a part") from exc
    finally:
        if not completed:  # disconnected, or cancelled: an abandoned update
            with anyio.CancelScope(shield=True):
                await uploads.abort(upload, "the client disconnected while sending a part")
    return size


class _FileSink:
    """A body written to a file, in pieces of about ``FLUSH_BYTES`` (off the event loop)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending: list[bytes] = []
        self._bytes = 0

    async def add(self, chunk: bytes) -> None:
        self._pending.append(chunk)
        self._bytes += len(chunk)
        if self._bytes >= FLUSH_BYTES:
            await self.finish()

    async def finish(self) -> None:
        pending, self._pending, self._bytes = self._pending, [], 0
        await anyio.to_thread.run_sync(_write, self._fd, pending)


class _BufferSink:
    """A body gathered in memory: into one buffer of its announced length (its pages huge
    where Linux offers them), else (a chunked body) its pieces, joined at the end."""

    def __init__(self, content_length: str | None) -> None:
        expected = int(content_length) if content_length and content_length.isdigit() else 0
        self._view = _bytes(huge_pages.empty([expected], torch.uint8)) if expected else None
        self._pieces: list[bytes] = []
        self._size = 0

    async def add(self, chunk: bytes) -> None:
        end = self._size + len(chunk)
        if self._view is None:
            self._pieces.append(chunk)
        elif end <= len(self._view):
            self._view[self._size : end] = chunk
        else:  # the HTTP layer holds a body to its length: a defect if reached
            raise APIError(400, "the body is longer than its Content-Length")
        self._size = end

    async def finish(self) -> None:
        pass

    def body(self) -> memoryview:
        if self._view is not None:
            return self._view[: self._size]
        return memoryview(bytearray(b"".join(self._pieces)))


def _bytes(buffer: torch.Tensor) -> memoryview:
    return memoryview(buffer.numpy().data).cast("B")


def _shared_file(path: str) -> tuple[Path, int]:
    """``path`` as a regular file in /dev/shm (links resolved: none leads out of it), and
    its size; ``APIError`` 400 otherwise."""
    file = Path(path)
    try:
        resolved = file.resolve(strict=True)
        stat = resolved.stat()
    except OSError as exc:
        raise APIError(400, f"path: {path!r} cannot be read: {exc.strerror}", param="path") from exc
    if not file.is_absolute() or not resolved.is_relative_to(SHARED_MEMORY.resolve()):
        raise APIError(400, f"path: {path!r} is not a file in {SHARED_MEMORY}", param="path")
    if not resolved.is_file():
        raise APIError(400, f"path: {path!r} is not a regular file", param="path")
    return resolved, stat.st_size


def _open(file: Path) -> int:
    """The part's file, new or written over (its size is set once the body is in)."""
    return os.open(file, os.O_WRONLY | os.O_CREAT, 0o600)


def _write(fd: int, chunks: list[bytes]) -> None:
    for chunk in chunks:
        write_all(fd, memoryview(chunk))


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: ERRORS[code] for code in (401, *codes)}
