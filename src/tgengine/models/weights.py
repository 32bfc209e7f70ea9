"""One resident copy of the weights: packing, unpacking and writing them, and what they take.

With ``Gemm.prepack`` on (CPU, where oneDNN packs the dtype), every linear weight lives in
oneDNN's packed layout only; its parameters hold one-element placeholders of the right shape.
Whatever writes weights (a weight update) goes through ``copy_weights``, which unpacks each
linear product it touches, writes, and packs it again: one product's plain form exists beside
its packed one for a moment, never the whole model's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tgengine.models.causal_lm import CausalLM
from tgengine.models.gemm import LinearWeights
from tgengine.models.shard import Shard


def pack_weights(model: CausalLM) -> None:
    """Pack every linear weight that packing applies to (a no-op without ``gemm.prepack``)."""
    for weights in model.linear_weights():
        model.gemm.pack(weights)


def drop_packed(model: CausalLM) -> None:
    """Forget the packed weights, whose values are being discarded (sleep level 2)."""
    for weights in model.linear_weights():
        model.gemm.drop(weights)


def copy_weights(model: CausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full tensors into the parameters named (validated by the caller), packed ones
    included; a sharded parameter takes its shard (``CausalLM.weight_shards``). A packed form
    that takes rows (pair panels) is written in place; any other is unpacked, written and
    packed again."""
    params = dict(model.named_parameters())
    shards = model.weight_shards
    owner: dict[int, tuple[LinearWeights, int]] = {}
    for weights in model.linear_weights():
        for index, p in enumerate(weights.params):
            owner[id(p)] = (weights, index)
    repack: list[LinearWeights] = []
    with torch.no_grad():
        for name, tensor in named:
            param = params[name]
            packed, index = owner.get(id(param), (None, 0))
            if packed is not None and packed.packed is not None:
                if model.gemm.write_rows(packed, index, _local(shards[name], tensor, param)):
                    continue
                model.gemm.unpack(packed)
                repack.append(packed)
            shards[name].copy_into(tensor, param.data)
    for weights in repack:
        model.gemm.pack(weights)


def _local(shard: Shard, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``: ``full`` itself where that is all of it, else a copy."""
    if shard.is_whole(param.shape) and full.shape == param.shape:
        return full
    local = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    shard.copy_into(full, local)
    return local


def resident_bytes(model: CausalLM) -> int:
    """Bytes the weights take: each parameter storage once, plus the packed weights."""
    storages: dict[int, int] = {}
    for p in model.parameters():
        if p.numel():
            storage = p.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) + model.gemm.packed_bytes
