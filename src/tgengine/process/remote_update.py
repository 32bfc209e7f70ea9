"""``RemoteWeightUpdate``: ``ProcessEngine.weight_update()``, an update in parts pushed to
the engine process through shared memory.

Each part is written to a safetensors file in ``/dev/shm`` (in a thread), and the engine
process reads it into its own memory and pushes it into its own ``Engine.weight_update()``
(``HostedUpdates``); the next part is written over it, and the file is removed when the
update ends. No tensor is pickled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from ..engine.weight_update import KeptKV
from ..errors import InvalidRequestError, TGEngineError
from ..ipc.weights_file import (
    FILE_NAME,
    new_weights_dir,
    remove_weights_dir,
    write_weights_file,
)
from .messages import ControlCommand, UpdateAbort, UpdateBegin, UpdateCommit, UpdatePart

if TYPE_CHECKING:
    import torch

ABORT_TIMEOUT = 10.0  # seconds an abort waits for the engine process (shielded)
Call = Callable[[str, ControlCommand], Awaitable[None]]


class RemoteWeightUpdate:
    """One update in parts: ``async with process_engine.weight_update() as update``.

    As ``Engine.weight_update()``: ``push`` checks each part in the engine process
    (``InvalidRequestError`` naming the tensor; that part is not staged), a clean exit
    from the block applies everything pushed at once, and an exception or a cancellation
    inside it applies nothing (the engine process is told, shielded, before the block is
    left). A cancelled ``push`` may still stage its part there; the abort drops it too.
    """

    def __init__(self, call: Call, update_id: int, kept_kv: KeptKV) -> None:
        if kept_kv not in ("recompute", "reuse"):
            raise InvalidRequestError("kept_kv", f"must be 'recompute' or 'reuse', got {kept_kv!r}")
        self._call = call
        self.update_id = update_id
        self.kept_kv: KeptKV = kept_kv
        self._phase = "new"
        self.num_parts = 0  # pushed and staged
        self._dirs: list[Path] = []  # the parts' files' directories in /dev/shm
        self._free: Path | None = None  # the one the next part may be written to

    async def __aenter__(self) -> RemoteWeightUpdate:
        if self._phase != "new":
            reason = f"this update is {self._phase}; open a new one"
            raise InvalidRequestError("weight_update", reason)
        await self._call("update weights", UpdateBegin(self.update_id, self.kept_kv))
        self._phase = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._end(exc_type)
        finally:
            for directory in self._dirs:
                remove_weights_dir(directory)
            self._dirs, self._free = [], None

    async def _end(self, exc_type: type[BaseException] | None) -> None:
        if exc_type is None:
            self._phase = "committed"
            try:
                await self._call("update weights", UpdateCommit(self.update_id))
            except BaseException:
                await self._abort()  # the commit did not get through: nothing may apply
                raise
            return
        await self._abort()

    async def _abort(self) -> None:
        self._phase = "abandoned"
        with anyio.move_on_after(ABORT_TIMEOUT, shield=True):
            try:
                await self._call("abort the weight update", UpdateAbort(self.update_id))
            except TGEngineError:
                # stopped, dead or gone: the engine process's update ended with it
                return

    async def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check and stage one part: an iterable of ``(name, tensor)`` (full tensors).

        The tensors are written to shared memory in a thread first: the caller may reuse
        its buffers once this returns. Every part goes through the same file, written
        over (the engine process reads each into its own memory): its pages are allocated
        once an update. Raises ``InvalidRequestError`` naming the first
        tensor that does not fit (nothing of this part is staged).
        """
        self._check_open()
        if self._free is None:
            self._free = await anyio.to_thread.run_sync(new_weights_dir)
            self._dirs.append(self._free)
        file, self._free = self._free / FILE_NAME, None
        await anyio.to_thread.run_sync(write_weights_file, list(named), file)
        await self.push_file(file)
        self._free = file.parent  # answered: the engine process has read it; else (an error
        # or a cancellation midway, when it may be reading it still) the next part takes a
        # new file

    async def push_file(self, path: str | Path, *, hold: bool = False) -> None:
        """Push the tensors of a safetensors file (or a directory's ``model.safetensors``)
        that the engine process can read; the caller removes it once this returns, or, with
        ``hold``, leaves it as it is until the update ended (``Engine``'s ``push_file``)."""
        self._check_open()
        part = UpdatePart(self.update_id, str(path), hold)
        await self._call("push a weight part", part)
        self.num_parts += 1

    def _check_open(self) -> None:
        if self._phase != "open":
            raise InvalidRequestError("weight_update", f"push into an update that is {self._phase}")
