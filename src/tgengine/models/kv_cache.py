"""``KVCache``: the paged key/value memory of every layer, in one tensor.

``kv`` has shape ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``; index 0
of the second axis holds keys, 1 values. A token's KV lives at row ``offset`` of block
``block_id`` of every layer and head.

The memory underneath is block-major (``[num_blocks, num_layers, 2, num_kv_heads, block_size,
head_dim]``) and ``kv`` is a permuted view of it: a block's keys and values, all layers and
heads, are one contiguous span, and a block's rows of one head are contiguous, which is what
the kernels read (``kernels.cache_layout``; the torch paths gather blocks with
``index_select``).

On a CPU the memory comes from an anonymous mapping: the kernel hands out zeroed pages on
first touch, so allocating costs nothing and a block's pages become resident only once a
sequence writes there. ``torch.zeros`` would write all of it at start-up and at every
``wakeup``: 0.3-4 s for the 512 MiB default on a VM whose fresh pages are slow to fault in.
The mapping asks for transparent huge pages: a sequence's blocks lie anywhere in the cache, so
with 4 KiB pages nearly every block a decode step reads was a TLB miss (and a TLB miss is
dear on a virtual machine). Since a block is contiguous, the first request makes one 2 MiB
page resident, not one per layer and head.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from tgengine.models.config import ModelConfig
from tgengine.models.parallel_layers import local_kv_heads
from tgengine.parallel import ParallelContext

log = logging.getLogger(__name__)


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
            num_blocks,
            config.num_layers,
            2,
            local_kv_heads(config, parallel or ParallelContext()),
            block_size,
            config.head_dim,
        )
        blocks = zeroed(shape, dtype, torch.device(device))
        return KVCache(kv=blocks.permute(1, 2, 3, 0, 4, 5), block_size=block_size)

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
        return int(self.kv.shape[3])

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())

    def layer_heads(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, a
        strided view (``kernels.cache_layout`` gives its strides)."""
        return self.kv[layer]


HUGE_PAGE = 2 << 20  # x86-64 and arm64 with 4 KiB pages


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU, pages that become resident only when first written.

    On CPU the mapping starts on a 2 MiB boundary and asks Linux for transparent huge pages
    (``MADV_HUGEPAGE``, where THP is ``madvise`` or ``always``); pages still become resident
    only when written, a huge page (2 MiB) at a time. The mapping lives as long as the tensor
    (or any view of it) does.
    """
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no such mapping
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(pages, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError as error:  # a kernel without transparent huge pages: small pages
            log.debug("KV cache without huge pages: %s", error)
    return torch.frombuffer(pages, dtype=dtype, count=count, offset=offset).view(shape)
