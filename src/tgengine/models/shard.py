"""``Shard``: which part of a full checkpoint tensor one tensor-parallel rank holds.

A shard is a list of ``(start, stop)`` ranges along one axis of the full tensor, laid side by
side in the rank's own tensor: one range for a plain split (a row-parallel weight's columns,
an embedding's rows), one per row block for fused weights (q, k and v heads; gate and up
rows), so that Phi-3's fused ``qkv_proj`` splits exactly like separate q/k/v projections.
Rows the local tensor has beyond the ranges are padding (zeros): the vocabulary, padded to a
multiple of the world size. At world size 1 every shard is the whole tensor.

``Shard.read_into`` reads only the rank's ranges from a safetensors file; ``Shard.copy_into``
takes them from a full in-memory tensor (a weight update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgengine.models.safetensors_reader import StoredTensor
from tgengine.runtime.parallel import ParallelContext


@dataclass(frozen=True)
class Shard:
    full_shape: torch.Size
    dim: int | None = None  # None: the whole tensor
    ranges: tuple[tuple[int, int], ...] = ()

    def is_whole(self, local_shape: torch.Size) -> bool:
        """Whether a local tensor of ``local_shape`` is all of the full one, as it is."""
        if self.dim is None:
            return True
        full = int(self.full_shape[self.dim])
        return tuple(local_shape) == tuple(self.full_shape) and self.ranges == ((0, full),)

    def copy_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write this shard of ``full`` (the whole tensor) into ``local`` (cast as needed)."""
        if self.dim is None:
            local.copy_(full)
            return
        offset = 0
        for start, stop in self.ranges:
            local.narrow(self.dim, offset, stop - start).copy_(
                full.narrow(self.dim, start, stop - start)
            )
            offset += stop - start
        self._zero_padding(local, offset)

    def read_into(self, stored: StoredTensor, local: torch.Tensor) -> None:
        """Read this shard of ``stored`` from disk into ``local``; nothing else is read."""
        if self.dim is None:
            stored.copy_into(local)
            return
        offset = 0
        for start, stop in self.ranges:
            stored.copy_slice_into(
                self.dim, start, stop, local.narrow(self.dim, offset, stop - start)
            )
            offset += stop - start
        self._zero_padding(local, offset)

    def _zero_padding(self, local: torch.Tensor, filled: int) -> None:
        assert self.dim is not None
        if filled < local.shape[self.dim]:
            local.narrow(self.dim, filled, local.shape[self.dim] - filled).zero_()


def whole(shape: torch.Size) -> Shard:
    return Shard(torch.Size(shape))


def split_units(
    units: int, parallel: ParallelContext, *, replicate: bool = False
) -> tuple[int, int]:
    """``(first, count)``: the equal share of ``units`` (heads, rows, columns) this rank takes.

    ``units`` must divide by the world size; with ``replicate``, fewer units than ranks are
    shared instead (the world size a multiple of them): each rank takes one, and
    ``world_size // units`` neighbouring ranks take the same one (KV heads).
    """
    world, rank = parallel.world_size, parallel.rank
    if units % world == 0:
        count = units // world
        return rank * count, count
    if replicate and units < world and world % units == 0:
        return rank * units // world, 1
    what = "a multiple or a divisor" if replicate else "a multiple"
    raise ValueError(f"{units} is not {what} of the tensor-parallel size {world}")


def padded_split(units: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """``(first, count, local)``: ``units`` padded to a multiple of the world size, split.

    Every rank holds ``local`` rows; the last ones may hold fewer real rows (``count``).
    """
    local = -(-units // parallel.world_size)
    first = min(parallel.rank * local, units)
    return first, min(local, units - first), local
