"""Weights for another process: written once to a safetensors file it maps back.

A pickle per tensor would copy every tensor through the socket; a safetensors file in
``/dev/shm`` (memory, where it exists) is one sequential write here and a memory-mapped
read there. The writer streams each tensor's bytes from its own memory (safetensors'
``save_file`` first builds a ``bytes`` copy of every tensor: twice the part at its peak),
and ``map_weights`` gives tensors that are views of the mapped file, so a reader copies
only what it keeps (a rank of the ``mp`` executor: its shard).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.safetensors_reader import (
    StoredTensor,
    file_header_length,
    header_length,
    header_tensors,
)
from ..runtime import huge_pages

SHARED_MEMORY = Path("/dev/shm")
FILE_NAME = "model.safetensors"
_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WRITE_BYTES = 64 * 1024 * 1024  # one write() at most (a larger one may be split anyway)


def new_weights_dir() -> Path:
    """A new, empty directory in shared memory (a temporary one where there is none)."""
    parent = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    return Path(tempfile.mkdtemp(prefix="tgengine-weights-", dir=parent))


def write_weights_dir(named: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """A new directory holding ``model.safetensors`` with every ``(name, tensor)``.

    Blocking. The caller removes it (``remove_weights_dir``). A tensor on another device
    is copied to the CPU first; one on the CPU is written from its own memory.
    """
    path = new_weights_dir()
    try:
        write_weights_file(named, path / FILE_NAME)
    except BaseException:
        remove_weights_dir(path)
        raise
    return path


def write_weights_file(named: Iterable[tuple[str, torch.Tensor]], file: Path) -> int:
    """Write ``named`` as one safetensors file; returns its size in bytes (blocking).

    An existing file is written over in place and then cut to size: in ``/dev/shm`` its
    pages are then reused, not allocated again (a page each 4 KiB). ``OSError`` (``ENOSPC``)
    before anything is written where the file system has no room for it."""
    size, pieces = safetensors_pieces(named)
    check_room(file, size)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for piece in pieces:
            write_all(fd, piece)
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return size


def check_room(file: Path, size: int) -> None:
    """Raise ``OSError`` (``ENOSPC``) unless ``file`` can grow to ``size`` bytes where it is.

    ``/dev/shm`` is often small (64 MiB in a container by default): a part that does not fit
    fails here, saying so, and not midway with a bare "No space left on device"."""
    try:
        have = file.stat().st_size
    except FileNotFoundError:
        have = 0
    stats = os.statvfs(file.parent)
    free = stats.f_bavail * stats.f_frsize
    if size - have > free:
        mib = 1 << 20
        raise OSError(
            errno.ENOSPC,
            f"{file.parent.parent} has {free / mib:.0f} MiB free, and the weights need "
            f"{(size - have) / mib:.0f} MiB more (a container's /dev/shm: --shm-size)",
            str(file),
        )


def safetensors_pieces(
    named: Iterable[tuple[str, torch.Tensor]], piece_bytes: int = _WRITE_BYTES
) -> tuple[int, Iterator[memoryview]]:
    """``named`` as safetensors bytes: the total size, and the pieces (at most
    ``piece_bytes`` each) to write or send in order, each a view of the header or of a
    tensor's own memory: nothing is copied (a tensor off the CPU is copied there first).
    The tensors must not change until the pieces are used."""
    given = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in named]
    # the widest elements first: every tensor's data then starts aligned to its dtype
    given.sort(key=lambda item: -item[1].element_size())
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in given:
        if tensor.dtype not in _CODES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        if name in header:
            raise ValueError(f"{name}: given twice")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    head = memoryview(len(encoded).to_bytes(8, "little") + encoded)

    def pieces() -> Iterator[memoryview]:
        yield head
        for _, tensor in given:
            data = _bytes_of(tensor)
            for start in range(0, len(data), piece_bytes):
                yield data[start : start + piece_bytes]

    return len(head) + offset, pieces()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    array = tensor.view(-1).view(torch.uint8).numpy()
    return memoryview(array.data).cast("B")


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may take fewer at a time)."""
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def map_weights(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file (or of a directory's ``model.safetensors``), as
    views of the file mapped copy-on-write: nothing is read until a tensor is used, and
    the pages stay the file's. Blocking. Raises ``ValueError`` for a file that is not
    safetensors or whose data does not match its header; ``OSError`` for one that is gone.

    The mapping lives as long as any of the tensors; the file may be removed at once.
    """
    named, held = hold_weights(path)
    held.close()  # the mapping stays: nothing checks the file afterwards
    return named


@dataclass
class HeldFile:
    """A file whose mapped tensors are in use (``hold_weights``): its descriptor stays
    open, so it may be removed meanwhile, and ``changed()`` says whether it was written
    since it was mapped. ``close()`` once its tensors are no longer needed as they are."""

    path: str
    fd: int
    size: int
    mtime_ns: int

    def changed(self) -> bool:
        stat = os.fstat(self.fd)
        return (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def hold_weights(path: str | Path) -> tuple[list[tuple[str, torch.Tensor]], HeldFile]:
    """``map_weights``, and the file held (``HeldFile``): nothing is read into this
    process's memory; on tmpfs the tensors are views of the file's own pages, as long as
    the writer leaves it as it is. The header is read through the descriptor that is
    mapped, so both are the same file. Blocking; ``ValueError`` and ``OSError`` as
    ``map_weights``."""
    file = Path(path)
    if file.is_dir():
        file = file / FILE_NAME
    fd = os.open(file, os.O_RDONLY)
    try:
        stat = os.fstat(fd)
        held = HeldFile(str(path), fd, stat.st_size, stat.st_mtime_ns)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            length = file_header_length(f.read(8), stat.st_size)
            header = f.read(length)
        try:
            stored = list(header_tensors(file, length, header, stat.st_size))
        except (KeyError, TypeError, AttributeError, struct.error) as exc:
            raise ValueError(f"not a safetensors header: {type(exc).__name__}: {exc}") from exc
        if not stored:
            return [], held
        return _views(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), stored), held
    except BaseException:
        os.close(fd)
        raise


def read_weights(
    path: str | Path, buffer: torch.Tensor | None = None
) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """The tensors of a safetensors file, read into memory of this process: into
    ``buffer`` (uint8) where it is large enough, else into a new one (its pages huge where
    Linux offers them); the tensors are views of it, and the buffer is returned for reuse
    once none of them is needed. The file may be rewritten or removed at once. Reading
    costs a copy, but a tmpfs mapping costs a fault (or, populated, a page-table entry) per
    4 KiB, about 3x the copy. Blocking; ``ValueError`` as ``map_weights``."""
    file = Path(path)
    if file.is_dir():
        file = file / FILE_NAME
    with open(file, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if buffer is None or buffer.numel() < size:
            buffer = huge_pages.empty([max(size, 1)], torch.uint8)
        view = memoryview(buffer.numpy().data).cast("B")[:size]
        done = 0
        while done < size:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{file} shrank while it was read")
            done += got
    return view_weights(view), buffer


def view_weights(buffer: memoryview) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in ``buffer`` (writable), as views of it:
    they keep it alive. Blocking (the header's parse). ``ValueError`` as ``map_weights``."""
    try:
        length = header_length(buffer)
        header = buffer[8 : 8 + length].tobytes()
        stored = list(header_tensors(Path("<body>"), length, header, len(buffer)))
    except (KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ValueError(f"not a safetensors header: {type(exc).__name__}: {exc}") from exc
    return _views(buffer, stored) if stored else []


def _views(buffer: Any, stored: list[StoredTensor]) -> list[tuple[str, torch.Tensor]]:
    """Each stored tensor as a view of ``buffer`` (the whole file's bytes)."""
    named: list[tuple[str, torch.Tensor]] = []
    for t in stored:
        element = torch.empty((), dtype=t.dtype).element_size()
        if t.end - t.begin != t.shape.numel() * element:
            raise ValueError(f"{t.name}: {t.end - t.begin} bytes for shape {tuple(t.shape)}")
        if t.begin == t.end:
            named.append((t.name, torch.empty(t.shape, dtype=t.dtype)))
            continue
        if t.begin % element:  # another writer's file: this one's bytes copied, aligned
            raw = torch.frombuffer(buffer, dtype=torch.uint8, offset=t.begin, count=t.end - t.begin)
            flat = raw.clone().view(t.dtype)
        else:
            flat = torch.frombuffer(buffer, dtype=t.dtype, offset=t.begin, count=t.shape.numel())
        named.append((t.name, flat.view(t.shape)))
    return named


def remove_weights_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
