"""Tensor-parallel layers: the one place that says how each weight splits across ranks.

- ``ColumnParallelLinear``: output rows split, block by block (q/k/v heads, gate/up rows;
  KV heads shared by neighbouring ranks when there are fewer of them than ranks). Each rank
  computes its own slice of the output; no communication.
- ``RowParallelLinear``: input columns split (o_proj over the rank's heads, down_proj over
  its intermediate rows). Each rank's output is a partial sum; the decoder layer all-reduces
  it once per block (``DecoderLayer``), after the MoE's sum over experts too.
- ``VocabParallelEmbedding`` and ``ParallelLMHead``: vocabulary rows split (padded to a
  multiple of the world size). A lookup outside the rank's rows yields zeros and one
  all-reduce completes the embedding; the head's logits slices are all-gathered.

They are ``nn.Linear`` / ``nn.Embedding`` with the local shapes and the checkpoint's names;
``shards`` maps a parameter name to its ``Shard`` of the full tensor, which loading and
weight updates use (``models.loader``, ``models.weights``). At world size 1 they are plain
layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tgengine.models.config import ModelConfig
from tgengine.models.gemm import LinearWeights, Panels
from tgengine.models.shard import Shard, padded_split, split_units, whole
from tgengine.runtime.parallel import ParallelContext


class _LoadedNotInitialised:
    """A layer whose values always come from a checkpoint: torch's random init is skipped.

    The model is built on the meta device, where ``nn.init.normal_`` alone imports
    ``torch._dynamo`` (1.4 s of every start-up); the values would be overwritten anyway.
    """

    def reset_parameters(self) -> None:
        pass


class ColumnParallelLinear(_LoadedNotInitialised, nn.Linear):
    """``blocks``: the full weight's row blocks as ``(units, rows per unit, replicate)``."""

    def __init__(
        self,
        in_features: int,
        blocks: Sequence[tuple[int, int, bool]],
        parallel: ParallelContext,
        *,
        bias: bool = False,
    ) -> None:
        ranges: list[tuple[int, int]] = []
        full = local = 0
        for units, unit_rows, replicate in blocks:
            first, count = split_units(units, parallel, replicate=replicate)
            ranges.append((full + first * unit_rows, full + (first + count) * unit_rows))
            full += units * unit_rows
            local += count * unit_rows
        super().__init__(in_features, local, bias=bias)
        self.shards = {"weight": Shard(torch.Size([full, in_features]), 0, tuple(ranges))}
        if bias:
            self.shards["bias"] = Shard(torch.Size([full]), 0, tuple(ranges))


class RowParallelLinear(_LoadedNotInitialised, nn.Linear):
    """Input columns split in ``units`` of ``unit_cols``; the output is a partial sum."""

    def __init__(
        self, units: int, unit_cols: int, out_features: int, parallel: ParallelContext
    ) -> None:
        first, count = split_units(units, parallel)
        super().__init__(count * unit_cols, out_features, bias=False)
        columns = ((first * unit_cols, (first + count) * unit_cols),)
        full = torch.Size([out_features, units * unit_cols])
        self.shards = {"weight": Shard(full, 1, columns)}


class VocabParallelEmbedding(_LoadedNotInitialised, nn.Embedding):
    """The rank's rows of the vocabulary; ``forward`` returns the full embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        first, count, local = padded_split(vocab_size, parallel)
        super().__init__(local, hidden_size)
        self.parallel = parallel
        self.first = first
        full = torch.Size([vocab_size, hidden_size])
        self.shards = {"weight": Shard(full, 0, ((first, first + count),))}
        self.as_head = LinearWeights([self], rows_read=True)
        """The weight as a tied output head's; when that packs it, lookups read the panels."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return self._rows(input_ids)
        local_ids = input_ids - self.first
        mine = (local_ids >= 0) & (local_ids < self.num_embeddings)
        x = self._rows(local_ids.masked_fill(~mine, 0))
        return self.parallel.all_reduce(x.masked_fill(~mine[:, None], 0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.as_head.packed
        if isinstance(packed, Panels):
            return packed.rows_at(ids)
        return F.embedding(ids, self.weight)


class ParallelLMHead(_LoadedNotInitialised, nn.Linear):
    """The rank's rows of the output projection (the vocabulary, padded like the embedding)."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: ParallelContext) -> None:
        first, count, local = padded_split(vocab_size, parallel)
        super().__init__(hidden_size, local, bias=False)
        full = torch.Size([vocab_size, hidden_size])
        self.shards = {"weight": Shard(full, 0, ((first, first + count),))}


def gather_logits(local: torch.Tensor, vocab_size: int, parallel: ParallelContext) -> torch.Tensor:
    """Every rank's logits slice side by side, the padding cut: ``[rows, vocab_size]``."""
    if not parallel.is_parallel:
        return local
    return parallel.all_gather_last_dim(local)[:, :vocab_size]


def shard_map(model: nn.Module) -> dict[str, Shard]:
    """``{parameter name: its Shard}`` for every parameter (the whole tensor where unsplit)."""
    shards = {name: whole(p.shape) for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        for param_name, shard in getattr(module, "shards", {}).items():
            shards[f"{prefix}.{param_name}" if prefix else param_name] = shard
    return shards


def local_heads(config: ModelConfig, parallel: ParallelContext) -> int:
    """Query heads on this rank."""
    return split_units(config.num_heads, parallel)[1]


def local_kv_heads(config: ModelConfig, parallel: ParallelContext) -> int:
    """KV heads on this rank (one, shared, when the ranks outnumber them)."""
    return split_units(config.num_kv_heads, parallel, replicate=True)[1]
