"""``WeightUploads``: the one weight update open over HTTP, and its watchdog.

An HTTP client opens an update, sends its parts one request at a time and commits or
aborts it; between those requests the server holds the engine's ``weight_update()`` open
here. An update nobody finishes is aborted and applies nothing: when no part arrives for
``timeout`` seconds (a part being received counts as arriving), when a client disconnects
while sending a part, and when the server stops.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import anyio
import anyio.abc

from ..engine.client import EngineClient, PartsUpdate
from ..ipc.weights_file import remove_weights_dir
from .errors import APIError


@runtime_checkable
class TakesBuffers(Protocol):
    """An update that takes a part as safetensors bytes in memory (``WeightUpdate``)."""

    async def push_buffer(self, buffer: memoryview) -> None: ...


class UploadsStopped(Exception):
    """The watchdog does not run (the server is stopping, or never started it)."""


@dataclass
class Upload:
    """One open update: its id, the engine's update, and what it has received."""

    id: str
    kept_kv: str
    update: PartsUpdate
    deadline: float
    num_parts: int = 0
    num_bytes: int = 0
    receiving: int = 0  # parts whose bodies are arriving now: the update is not idle
    spare_dir: Path | None = None  # the last part's file's directory, for the next part
    state: Literal["open", "committed", "aborted"] = "open"
    reason: str | None = None  # why it was aborted
    changed: anyio.Event = field(default_factory=anyio.Event)  # the watchdog's wake-up

    def touch(self) -> None:
        """Wake the watchdog: the state, ``receiving`` or the deadline changed."""
        self.changed.set()
        self.changed = anyio.Event()


class WeightUploads:
    """At most one open update of ``engine``; ``run()`` must run for any to open."""

    def __init__(self, engine: EngineClient, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        self._open: Upload | None = None
        self._opening = False
        self._recent: dict[str, Upload] = {}  # ended updates, so a late call learns why
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing: anyio.Event | None = None  # set once an aborted update has ended

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch each open update; returns only when cancelled, after aborting the open one."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            if self._open is not None:
                with anyio.CancelScope(shield=True):
                    await self.abort(self._open, "the server stopped")

    async def begin(self, kept_kv: Literal["recompute", "reuse"]) -> Upload:
        """Open an update; ``APIError`` 409 while one is open, or the engine's error."""
        if self._tg is None:
            raise UploadsStopped("the server is not taking weight updates")
        if self._open is not None or self._opening:
            open_id = self._open.id if self._open else "being opened"
            message = f"a weight update is open already ({open_id})"
            raise APIError(409, message, type="conflict_error", code="update_open")
        self._opening = True
        try:
            if self._closing is not None:  # an abort still ending in the engine
                await self._closing.wait()
            update = self.engine.weight_update(kept_kv=kept_kv)
            await update.__aenter__()
        finally:
            self._opening = False
        upload = Upload(secrets.token_hex(8), kept_kv, update, anyio.current_time() + self.timeout)
        self._open = upload
        self._tg.start_soon(self._watch, upload)
        return upload

    def get(self, update_id: str) -> Upload:
        """The update of that id, open or recently ended; ``APIError`` 404 otherwise."""
        upload = self._open if self._open and self._open.id == update_id else None
        upload = upload or self._recent.get(update_id)
        if upload is None:
            message = f"no weight update {update_id!r}"
            raise APIError(404, message, type="not_found_error", code="update_not_found")
        return upload

    def check_open(self, upload: Upload) -> None:
        if upload.state != "open":
            why = f": {upload.reason}" if upload.reason else ""
            message = f"weight update {upload.id} is {upload.state}{why}"
            raise APIError(409, message, type="conflict_error", code=f"update_{upload.state}")

    def receiving(self, upload: Upload) -> _Receiving:
        """A block while a part's body arrives: the update does not time out meanwhile."""
        return _Receiving(self, upload)

    async def push(self, upload: Upload, path: Path, nbytes: int, *, hold: bool = False) -> None:
        """Push the part in the safetensors file ``path`` (the caller removes it; ``hold``:
        the engine maps it and holds it until the update ends)."""
        self.check_open(upload)
        with self.receiving(upload):
            await upload.update.push_file(path, hold=hold)
        upload.num_parts += 1
        upload.num_bytes += nbytes

    def takes_buffers(self, upload: Upload) -> bool:
        """Whether the update takes a part's bytes from memory (an engine in this process)."""
        return isinstance(upload.update, TakesBuffers)

    async def push_buffer(self, upload: Upload, buffer: memoryview, nbytes: int) -> None:
        """Push the part in ``buffer`` (safetensors bytes the update takes over)."""
        self.check_open(upload)
        assert isinstance(upload.update, TakesBuffers)
        with self.receiving(upload):
            await upload.update.push_buffer(buffer)
        upload.num_parts += 1
        upload.num_bytes += nbytes

    async def commit(self, upload: Upload) -> None:
        """Apply every part at once; raises what the engine's commit raises."""
        self.check_open(upload)
        self._end(upload, "committed")
        try:
            await upload.update.__aexit__(None, None, None)
        except BaseException as exc:
            upload.state, upload.reason = "aborted", f"the commit failed: {exc}"
            raise

    async def abort(self, upload: Upload, reason: str) -> None:
        """Drop the update: nothing of it applies. No-op once it ended."""
        if upload.state != "open":
            return
        self._end(upload, "aborted", reason)
        error = _Abandoned(reason)
        closing = self._closing = anyio.Event()  # the next begin waits for the engine's end
        try:
            await upload.update.__aexit__(_Abandoned, error, None)
        finally:
            closing.set()
            if self._closing is closing:
                self._closing = None

    def _end(
        self, upload: Upload, state: Literal["committed", "aborted"], reason: str | None = None
    ) -> None:
        upload.state, upload.reason = state, reason
        if upload.spare_dir is not None:
            remove_weights_dir(upload.spare_dir)
            upload.spare_dir = None
        if self._open is upload:
            self._open = None
        self._recent[upload.id] = upload
        while len(self._recent) > 16:
            del self._recent[next(iter(self._recent))]
        upload.touch()

    async def _watch(self, upload: Upload) -> None:
        """Abort ``upload`` once it sat ``timeout`` seconds without a part; returns once it
        ended."""
        while upload.state == "open":
            changed = upload.changed
            if upload.receiving:
                await changed.wait()
                continue
            with anyio.move_on_at(upload.deadline) as idle:
                await changed.wait()
            if idle.cancelled_caught and upload.state == "open" and not upload.receiving:
                await self.abort(upload, f"no part arrived for {self.timeout:g} seconds")


class _Receiving:
    def __init__(self, uploads: WeightUploads, upload: Upload) -> None:
        self._uploads, self._upload = uploads, upload

    def __enter__(self) -> None:
        self._upload.receiving += 1
        self._upload.touch()

    def __exit__(self, *exc_info: object) -> None:
        self._upload.receiving -= 1
        self._upload.deadline = anyio.current_time() + self._uploads.timeout
        self._upload.touch()


class _Abandoned(Exception):
    """What the engine's update block exits with when the server drops it."""
