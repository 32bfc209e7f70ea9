"""Read safetensors files tensor by tensor with plain reads, straight into their destination.

The format is an 8-byte little-endian header length, a JSON header (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}}``, offsets from the end of the header) and the raw
bytes. ``safetensors.safe_open`` memory-maps the whole file, and every page a load touches
then counts in the process's RSS until the file is closed: a single-file checkpoint peaks at
twice its size. Reading each tensor with ``readinto`` into the parameter it fills costs no
second copy and leaves nothing mapped; a tensor stored in another dtype (the default model's
float32 file loaded as bfloat16) passes through one small buffer, a chunk at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024
_CHUNK_BYTES = 8 * 1024 * 1024  # a tensor stored in another dtype is converted this much at a time


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, not read yet."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: torch.Size
    begin: int  # absolute byte offsets in the file
    end: int

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def copy_into(self, param: torch.Tensor) -> None:
        """Fill ``param`` (same shape; any dtype and device) with this tensor's values."""
        if param.device.type == "cpu" and param.is_contiguous():
            self.read_into(param)
        else:
            param.copy_(self.read())

    def read_into(self, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, on CPU, this tensor's shape; any dtype)."""
        if out.shape != self.shape:
            raise ValueError(f"{self.name}: {tuple(self.shape)} on disk, {tuple(out.shape)} given")
        with open(self.file, "rb", buffering=0) as f:
            self._read_converted_at(f, self.begin, out)

    def copy_slice_into(self, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        """Fill ``out`` with ``tensor.narrow(dim, start, stop - start)``, reading only that.

        ``dim`` is 0 (rows: one contiguous read) or 1 (columns: one read per row).
        """
        expected = list(self.shape)
        expected[dim] = stop - start
        if list(out.shape) != expected or dim not in (0, 1) or not 0 <= start <= stop:
            raise ValueError(
                f"{self.name}: slice {start}:{stop} of dim {dim} does not fit {tuple(out.shape)}"
            )
        if dim == 1 and (start, stop) == (0, self.shape[1]):
            dim, stop = 0, self.shape[0]  # every column: the rows' bytes, in one piece
        row_bytes = (self.end - self.begin) // max(1, self.shape[0])
        rows_in_place = dim == 0 and out.device.type == "cpu" and out.is_contiguous()
        with open(self.file, "rb", buffering=0) as f:
            if rows_in_place:
                self._read_converted_at(f, self.begin + start * row_bytes, out)
                return
            target = torch.empty(out.shape, dtype=self.dtype)
            if dim == 0:
                self._read_at(f, self.begin + start * row_bytes, target)
            else:
                element = target.element_size()
                for row in range(target.shape[0]):
                    self._read_at(f, self.begin + row * row_bytes + start * element, target[row])
        out.copy_(target)

    def _read_converted_at(self, f: BinaryIO, position: int, out: torch.Tensor) -> None:
        """Fill contiguous CPU ``out`` from ``position`` on, converting to its dtype in
        chunks of at most ``_CHUNK_BYTES``: no full-size copy in the stored dtype."""
        if out.dtype == self.dtype:
            self._read_at(f, position, out)
            return
        flat = out.view(-1)
        element = torch.empty((), dtype=self.dtype).element_size()
        per_chunk = max(1, _CHUNK_BYTES // element)
        chunk = torch.empty(min(per_chunk, flat.numel()), dtype=self.dtype)
        for first in range(0, flat.numel(), per_chunk):
            part = chunk[: min(per_chunk, flat.numel() - first)]
            self._read_at(f, position + first * element, part)
            flat[first : first + part.numel()].copy_(part)

    def _read_at(self, f: BinaryIO, position: int, out: torch.Tensor) -> None:
        nbytes = out.numel() * out.element_size()
        if nbytes == 0:
            return
        view = out.detach().view(-1).view(torch.uint8).numpy().data
        f.seek(position)
        done = 0
        while done < nbytes:
            count = f.readinto(view[done:])  # type: ignore[attr-defined]
            if not count:
                raise ValueError(f"{self.name}: the file ends before its data does")
            done += count


def stored_tensors(file: Path) -> Iterator[StoredTensor]:
    """The tensors of one file, in the order of their data."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8) or b"\0" * 8)
        if not 0 < length <= _MAX_HEADER:
            raise ValueError(f"header length {length} is not plausible")
        header = f.read(length)
        size = f.seek(0, 2)
    yield from header_tensors(file, length, header, size)


def header_length(data: memoryview) -> int:
    """The header length a safetensors buffer starts with (``ValueError`` if implausible)."""
    return file_header_length(data[:8].tobytes(), len(data))


def file_header_length(head: bytes, size: int) -> int:
    """The header length in ``head``, the first 8 bytes of a safetensors file of ``size``
    bytes (``ValueError`` if implausible)."""
    (length,) = struct.unpack("<Q", head[:8].ljust(8, b"\0"))
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise ValueError(f"header length {length} is not plausible")
    return int(length)


def header_tensors(
    file: Path, length: int, header_bytes: bytes, size: int
) -> Iterator[StoredTensor]:
    """The tensors a safetensors header of ``length`` bytes describes, in a file (or a
    buffer: ``file`` then only names it) of ``size`` bytes, in the order of their data."""
    header = json.loads(header_bytes)
    start = 8 + length
    entries = sorted(
        ((name, meta) for name, meta in header.items() if name != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][0],
    )
    for name, meta in entries:
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{name}: unsupported dtype {meta['dtype']}")
        begin, end = (start + int(o) for o in meta["data_offsets"])
        if not start <= begin <= end <= size:
            raise ValueError(f"{name}: data offsets outside the file")
        yield StoredTensor(file, name, dtype, torch.Size(meta["shape"]), begin, end)
