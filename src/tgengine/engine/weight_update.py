"""``WeightUpdate``: a weight update pushed in parts, applied all at once when it commits.

``Engine.weight_update()`` returns one; ``async with`` opens it, ``push`` checks and stages
each part as it arrives, and a clean exit from the block commits every staged tensor at once,
between two steps. An exception or a cancellation inside the block drops what was staged.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

import anyio
import anyio.lowlevel
import torch

from ..agent.weight_checks import WeightSpecs, check_finite, check_named
from ..errors import IllegalStateError, InvalidRequestError
from ..ipc.weights_file import HeldFile, hold_weights, read_weights, view_weights
from ..models import iter_safetensors
from ..runtime import huge_pages

KeptKV = Literal["recompute", "reuse"]
Named = list[tuple[str, torch.Tensor]]


class Absorber(Protocol):
    """Where an update's parts can become weights as they arrive (the weights asleep at
    level 2: ``agent.packed_parts``): ``absorb`` packs what it can of a checked part and
    says which names it took (``InvalidRequestError`` for one not finite: then none count);
    the commit settles the names taken; ``drop`` forgets them (no commit)."""

    async def absorb(self, named: Named) -> list[str]: ...

    async def drop(self) -> None: ...


class UpdateSlot:
    """Where an engine's one open update sits: a second one is refused."""

    def __init__(self) -> None:
        self.open: WeightUpdate | None = None

    def take(self, update: WeightUpdate, state: str) -> None:
        if self.open is not None:
            raise IllegalStateError("open a second weight update", f"{state} with one open")
        self.open = update

    def let_go(self, update: WeightUpdate) -> None:
        if self.open is update:
            self.open = None


DIR_PART_BYTES = 64 * 1024 * 1024  # a directory is pushed in parts of about this size


def next_part(tensors: Iterator[tuple[str, torch.Tensor]], part_bytes: int) -> Named:
    """The next tensors read from ``tensors`` up to about ``part_bytes`` (at least one;
    none once it is exhausted). Blocking: each is read from disk as it comes."""
    part: Named = []
    size = 0
    for name, tensor in tensors:
        part.append((name, tensor))
        size += tensor.nbytes
        if size >= part_bytes:
            break
    return part


def view_part(buffer: memoryview) -> Named:
    """The tensors of a safetensors file in ``buffer``, as views of it; ``InvalidRequestError``
    for bytes that are not one."""
    try:
        return view_weights(buffer)
    except ValueError as exc:
        raise InvalidRequestError("weights", f"not a safetensors file: {exc}") from exc


def hold_part(path: str) -> tuple[Named, HeldFile]:
    """The tensors of a pushed safetensors file, as views of it, mapped, and the file held
    (blocking); ``InvalidRequestError`` for a file that is not one."""
    try:
        return hold_weights(path)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError("weights", f"not a safetensors file: {exc}") from exc


def read_part(path: str, buffer: torch.Tensor | None) -> tuple[Named, torch.Tensor]:
    """The tensors of a pushed safetensors file, read into ``buffer`` or a new one
    (blocking); ``InvalidRequestError`` for a file that is not one."""
    try:
        return read_weights(path, buffer)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError("weights", f"not a safetensors file: {exc}") from exc


class _Phase(enum.Enum):
    NEW = "new"
    OPEN = "open"
    COMMITTED = "committed"
    ABANDONED = "abandoned"


class WeightUpdate:
    """One update in parts: ``async with engine.weight_update() as update``.

    ``await update.push(named)`` checks the tensors (an unknown name, a wrong shape, a dtype
    that cannot be cast, a NaN or an infinity: ``InvalidRequestError`` naming the tensor,
    and that part is not staged) and copies them, off the event loop, into each weight's
    dtype on the engine's device: the caller may reuse its buffers at once. A name pushed
    again replaces its earlier tensor. When the block exits cleanly the staged tensors apply
    at once and ``weight_version`` increments; an exception or a cancellation inside the
    block applies nothing; once the commit has the engine between two steps it completes
    (shielded). An update is used once: entering it again, or pushing after it ended,
    raises ``InvalidRequestError``. With the weights asleep the committed tensors wait for
    ``wakeup(["weights"])``; at level 2 each becomes its weight (no second copy), and only
    weights nobody pushed are read from the model directory.
    """

    def __init__(
        self,
        specs: WeightSpecs,
        device: torch.device,
        kept_kv: KeptKV,
        slot: UpdateSlot,
        check: Callable[[KeptKV], str],
        commit: Callable[[Named, KeptKV, list[str], set[str]], Awaitable[None]],
        absorber: Absorber | None = None,
    ) -> None:
        if kept_kv not in ("recompute", "reuse"):
            raise InvalidRequestError("kept_kv", f"must be 'recompute' or 'reuse', got {kept_kv!r}")
        self._specs = specs
        self._device = device
        self.kept_kv: KeptKV = kept_kv
        self._slot, self._check, self._commit = slot, check, commit
        self._staged: dict[str, torch.Tensor] = {}
        self._absorber = absorber
        self._absorbed: set[str] = set()  # names the executor packed as their parts came
        self._spare: torch.Tensor | None = None  # a part's memory, free for the next one
        self._held: list[HeldFile] = []  # files whose mapped tensors are staged as they are
        self._held_names: set[str] = set()  # the names staged as views of those files
        self._absorbing = False  # a part was offered to the absorber: drop it if abandoned
        self._phase = _Phase.NEW
        self._lock = anyio.Lock()  # pushes stage one at a time

    @property
    def num_staged(self) -> int:
        """How many tensors are staged so far (absorbed ones included)."""
        return len(self._staged) + len(self._absorbed)

    @property
    def staged_bytes(self) -> int:
        """Bytes staged here (not counting what the executor absorbed)."""
        return sum(t.nbytes for t in self._staged.values())

    async def __aenter__(self) -> WeightUpdate:
        if self._phase is not _Phase.NEW:
            raise InvalidRequestError(
                "weight_update", f"this update is {self._phase.value}; open a new one"
            )
        state = self._check(self.kept_kv)  # raises if the engine cannot take an update now
        self._slot.take(self, state)
        self._phase = _Phase.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        staged, self._staged = self._staged, {}
        absorbed, self._absorbed = sorted(self._absorbed), set()
        held, self._held = self._held, []
        held_names, self._held_names = self._held_names & staged.keys(), set()
        self._spare = None
        try:
            if exc_type is None:
                self._phase = _Phase.COMMITTED
                _check_unchanged(held)
                await self._commit(list(staged.items()), self.kept_kv, absorbed, held_names)
        except BaseException:
            self._phase = _Phase.ABANDONED
            raise
        finally:
            if self._phase is _Phase.OPEN:
                self._phase = _Phase.ABANDONED
            if self._phase is _Phase.ABANDONED and self._absorbing and self._absorber:
                with anyio.CancelScope(shield=True):  # after a push still packing, if any
                    await self._absorber.drop()
            staged.clear()
            for file in held:
                file.close()
            self._slot.let_go(self)

    async def push(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check and stage one part: an iterable of ``(name, tensor)`` (full tensors).

        Raises ``InvalidRequestError`` naming the first tensor that does not fit; then
        nothing of this part is staged (earlier parts stay). Cancelling it stages nothing.
        """
        await self._stage(named, copy=True)

    async def push_file(self, path: str | Path, *, hold: bool = False) -> None:
        """Check and stage the tensors of one safetensors file, as ``push`` does, read into
        memory of the update's own: the file may be rewritten or removed once this returns.
        The tensors are staged as views of that memory (one copy of what was pushed, until
        the commit), or, while the weights sleep at level 2, packed into the weights at once
        (then the memory serves the next part). A file that is not safetensors raises
        ``InvalidRequestError``.

        ``hold=True``: the file is mapped, not read, and its tensors are staged as views of
        it, so that in ``/dev/shm`` the file's own pages are the one copy of what was pushed:
        the writer must leave it as it is until the update ends (it may remove it, or
        replace it by a rename: the update holds the file it mapped). A file written in place
        meanwhile fails the commit with ``InvalidRequestError``, and nothing applies: seen by
        its size or modification time, so a write within one tick of the file system's clock
        (a few ms on tmpfs) after the push may go unseen; the check is a net, not a lock.
        Staged by the executor for a wakeup, held tensors are copied at the commit."""
        if hold:
            named, file = await anyio.to_thread.run_sync(hold_part, str(path))
            names = [name for name, _ in named]
            kept = False
            try:
                if kept := await self._stage(named, copy=False):  # views of it are staged
                    self._held.append(file)
                    self._held_names.update(n for n in names if n in self._staged)
            finally:
                if not kept:
                    file.close()
            return
        spare, self._spare = self._spare, None
        named, buffer = await anyio.to_thread.run_sync(read_part, str(path), spare)
        if not await self._stage(named, copy=False):
            self._spare = buffer  # nothing of it is staged as a view: reused

    async def push_buffer(self, buffer: memoryview) -> None:
        """Check and stage the tensors of a safetensors file held in ``buffer``, which the
        update takes over (its tensors are views of it: the caller must not write it again),
        as ``push_file`` does. A buffer that is not safetensors raises
        ``InvalidRequestError``."""
        named = await anyio.to_thread.run_sync(view_part, buffer)
        await self._stage(named, copy=False)

    async def push_source(
        self, source: str | Path | Iterable[tuple[str, torch.Tensor]], *, own: bool
    ) -> None:
        """Push a directory of safetensors (read off the event loop, in parts of about
        ``DIR_PART_BYTES``: what it holds is never in memory whole beside what it becomes)
        or an iterable; ``own``: the iterable's tensors are staged as they are where they
        fit (``update_weights`` awake, which copies them into the weights at once)."""
        if isinstance(source, (str, Path)):
            tensors = iter(iter_safetensors(str(source)))
            while part := await anyio.to_thread.run_sync(next_part, tensors, DIR_PART_BYTES):
                await self._stage(part, copy=False)
        else:
            await self._stage(source, copy=not own)

    async def _stage(self, named: Iterable[tuple[str, torch.Tensor]], *, copy: bool) -> bool:
        """``copy=False``: the tensors are the engine's already (read from a directory); they
        are converted only where their dtype or device differs. Returns whether any of them
        may be staged as it is (not copied)."""
        if self._phase is not _Phase.OPEN:
            raise InvalidRequestError(
                "weight_update", f"push into an update that is {self._phase.value}"
            )
        part = check_named(self._specs, list(named))
        async with self._lock:
            taken: set[str] = set()
            fresh = [(n, t) for n, t in part if n not in self._absorbed]
            if self._absorber is not None and fresh:
                self._absorbing = True
                with anyio.CancelScope(shield=True):  # the executor's thread runs to its end
                    taken = set(await self._absorber.absorb(fresh))
                await anyio.lowlevel.checkpoint_if_cancelled()  # then nothing of it counts
            rest = [(n, t) for n, t in part if n not in taken]
            # a view staged would keep the whole part it maps alive: what was not absorbed
            # of a part that was (norms, mostly) is copied, and the part can go
            copy = copy or bool(taken)
            staged = await anyio.to_thread.run_sync(self._convert, rest, copy)
            if self._phase is _Phase.OPEN:  # not ended while the part was converted
                for name in taken:
                    self._staged.pop(name, None)  # pushed before, the plain way: replaced
                self._absorbed |= taken
                self._held_names -= taken | staged.keys()  # replaced, if held before
                self._staged.update(staged)
        return not copy

    def _convert(self, part: Named, copy: bool) -> dict[str, torch.Tensor]:
        staged: dict[str, torch.Tensor] = {}
        on_cpu = self._device.type == "cpu"
        for name, tensor in part:
            dtype, t = self._specs[name][1], tensor.detach()
            if on_cpu and t.device.type == "cpu" and (copy or t.dtype != dtype):
                staged[name] = huge_pages.empty(t.shape, dtype)  # faults 2 MiB a time
                staged[name].copy_(t)
            else:
                staged[name] = t.to(self._device, dtype, copy=copy).contiguous()
            check_finite(name, staged[name])
        return staged


def _check_unchanged(held: list[HeldFile]) -> None:
    """``InvalidRequestError`` if a held file was written after it was pushed."""
    for file in held:
        if file.changed():
            reason = f"{file.path} was written after it was pushed (held until the commit)"
            raise InvalidRequestError("weights", reason)
