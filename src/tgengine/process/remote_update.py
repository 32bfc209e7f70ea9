"""``RemoteWeightUpdate``: ``ProcessEngine.weight_update()``, an update in parts pushed to
the engine process through shared memory.

Each part is written to a safetensors file in ``/dev/shm`` (in a thread), and the engine
process pushes it from a mapping of that file into its own ``Engine.weight_update()``
(``HostedUpdates``); the file is removed once it answered. No tensor is pickled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import anyio

from ..engine.weight_update import KeptKV
from ..errors import InvalidRequestError, TGEngineError
from ..ipc.weights_file import remove_weights_dir, write_weights_dir
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
        its buffers once this returns. Raises ``InvalidRequestError`` naming the first
        tensor that does not fit (nothing of this part is staged).
        """
        self._check_open()
        path = await anyio.to_thread.run_sync(write_weights_dir, list(named))
        try:
            await self.push_file(path)
        finally:
            remove_weights_dir(path)

    async def push_file(self, path: str | Path) -> None:
        """Push the tensors of a safetensors file (or a directory's ``model.safetensors``)
        that the engine process can read; the caller removes it once this returns."""
        self._check_open()
        await self._call("push a weight part", UpdatePart(self.update_id, str(path)))
        self.num_parts += 1

    def _check_open(self) -> None:
        if self._phase != "open":
            raise InvalidRequestError("weight_update", f"push into an update that is {self._phase}")
