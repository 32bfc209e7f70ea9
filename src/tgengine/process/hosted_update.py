"""``HostedUpdates``: the engine process's side of ``ProcessEngine.weight_update()``.

The parent's block becomes messages (``UpdateBegin``, ``UpdatePart``s, ``UpdateCommit`` or
``UpdateAbort``); here they drive one ``Engine.weight_update()``: entered at the begin, each
part pushed from its file, left cleanly at the commit (everything applies at once) or with
an error at the abort, or when the host ends (nothing applies).
"""

from __future__ import annotations

from ..engine.engine import Engine
from ..engine.weight_update import WeightUpdate
from ..errors import InvalidRequestError
from .messages import UpdateAbort, UpdateBegin, UpdateCommit, UpdatePart

UpdateCommand = UpdateBegin | UpdatePart | UpdateCommit | UpdateAbort


class UpdateAborted(Exception):
    """What an update's block exits with here when the parent's block did not end cleanly."""


class HostedUpdates:
    """At most one open update of ``engine``, by the parent's update id."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open: tuple[int, WeightUpdate] | None = None

    async def handle(self, command: UpdateCommand) -> None:
        """Carry out one message; raises what the engine's update raises (the parent's)."""
        match command:
            case UpdateBegin(update_id, kept_kv):
                update = self._engine.weight_update(kept_kv=kept_kv)
                await update.__aenter__()  # refused: a second update, or the state forbids
                self._open = (update_id, update)
            case UpdatePart(update_id, path, hold):
                await self._get(update_id).push_file(path, hold=hold)
            case UpdateCommit(update_id):
                update = self._get(update_id)
                self._open = None  # a late part of it is refused from now on
                await update.__aexit__(None, None, None)
            case UpdateAbort(update_id):
                if self._open is not None and self._open[0] == update_id:
                    await self.close()

    async def close(self) -> None:
        """Leave the open update, if any, with an error: nothing of it applies."""
        if self._open is None:
            return
        _, update = self._open
        self._open = None
        error = UpdateAborted("the update was aborted")
        await update.__aexit__(UpdateAborted, error, None)

    def _get(self, update_id: int) -> WeightUpdate:
        if self._open is None or self._open[0] != update_id:
            reason = f"update {update_id} is not open (committed, aborted, or never begun)"
            raise InvalidRequestError("weight_update", reason)
        return self._open[1]
