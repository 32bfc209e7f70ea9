"""``KVCache``: the paged key/value memory of every layer, in one tensor.

``kv`` has shape ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]``; index 0
of the second axis holds keys, 1 values. A token's KV lives at the flat slot
``block_id * block_size + offset`` of every layer.

The memory underneath is head-major (``[num_layers, 2, num_kv_heads, slots, head_dim]``) and
``kv`` is a permuted view of it: gathering a sequence's blocks then yields each head's keys
contiguously, which is the layout the attention matmuls read without another copy.

On a CPU the memory comes from an anonymous mapping: the kernel hands out zeroed pages on
first touch, so allocating costs nothing and a block's pages become resident only once a
sequence writes there. ``torch.zeros`` would write all of it at start-up and at every
``wakeup``: 0.3-4 s for the 512 MiB default on a VM whose fresh pages are slow to fault in.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from tgengine.models.config import ModelConfig
from tgengine.models.parallel_layers import local_kv_heads
from tgengine.runtime.parallel import ParallelContext


@dataclass
class KVCache:
    kv: torch.Tensor
    block_size: int

    @staticmethod
    def allocate(
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: ParallelContext | None = None,
    ) -> KVCache:
        """Allocate a zeroed cache (zeros, so masked-out slots never inject NaN).

        With ``parallel``, only this rank's KV heads (``local_kv_heads``).
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        shape = (
            config.num_layers,
            2,
            local_kv_heads(config, parallel or ParallelContext()),
            num_blocks * block_size,
            config.head_dim,
        )
        heads = zeroed(shape, dtype, torch.device(device))
        return KVCache(kv=heads.permute(0, 1, 3, 2, 4), block_size=block_size)

    @staticmethod
    def bytes_per_block(
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
    ) -> int:
        """Bytes one block takes across all layers, keys and values (this rank's heads)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        heads = local_kv_heads(config, parallel or ParallelContext())
        per_token = config.num_layers * 2 * heads * config.head_dim
        return per_token * block_size * element_size

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2]) // self.block_size

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())

    def layer_heads(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, a view."""
        heads = self.kv[layer].permute(0, 2, 1, 3)
        if not heads.is_contiguous():
            raise ValueError("KVCache.kv must be a view of head-major memory (use allocate)")
        return heads.view(2, heads.shape[1], self.num_blocks, self.block_size, heads.shape[-1])


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU, pages that become resident only when first written.

    The mapping lives as long as the tensor (or any view of it) does.
    """
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no such mapping
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
