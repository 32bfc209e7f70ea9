"""Weights committed while the agent's weights are not resident: they wait for the wakeup.

A weight update committed while the weights sleep cannot be copied anywhere. The agent keeps
the committed tensors (``Engine.weight_update`` made them private copies, in each
parameter's dtype and on its device) and its next ``wakeup("weights")`` builds the
parameters from them: at level 2 a staged tensor that is exactly the parameter (its shard's
shape, dtype, device, contiguous) *becomes* the parameter, with no second copy, and only
the names nobody pushed are read from the model directory. Linear weights packed as their
parts arrived (``packed_parts``) become their weights as they are.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import ModelLoadError
from ..models import CausalLM, iter_stored, load_weights
from ..models.weights import copy_weights
from .packed_parts import PanelGroup, install_staged_panels


def merge_staged(
    staged: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Add ``named`` to ``staged``; a later tensor of a name replaces the earlier one."""
    for name, tensor in named:
        staged[name] = tensor


def rebuild_from_staged(
    model: CausalLM,
    staged: dict[str, torch.Tensor],
    staged_panels: dict[int, PanelGroup],
    local_shapes: dict[str, torch.Size],
    device: torch.device,
    model_dir: str,
) -> bool:
    """Level-2 wakeup with staged weights: adopt what fits, read the rest from ``model_dir``.

    ``staged_panels``: linear weights packed as their parts arrived (``packed_parts``);
    they become those weights, and the parameters they do not cover are written into them.
    Consumes both. Returns True when any parameter was read from the model directory.
    """
    params = dict(model.named_parameters())
    packed = {  # parameter ids the staged panels hold, unless a later part staged them plain
        id(g.weights.params[i]) for g in staged_panels.values() for i in g.covered
    }
    pushed: set[str] = set()
    shards: list[tuple[str, torch.Tensor]] = []
    for name, p in params.items():
        shape = local_shapes[name]
        tensor = staged.pop(name, None)
        if tensor is None and id(p) in packed:
            pushed.add(name)  # a placeholder of its shape, as a packed weight's
            p.data = torch.zeros((), dtype=p.dtype, device=device).expand(shape)
            continue
        packed.discard(id(p))
        if tensor is not None:
            pushed.add(name)
            if _fits(tensor, shape, p.dtype, p.device):  # the placeholder's: cuda:0, not cuda
                p.data = tensor  # the pushed tensor becomes the weight: no second copy
                continue
            shards.append((name, tensor))  # a rank's shard of it: copied below
        p.data = torch.empty(shape, dtype=p.dtype, device=device)
    staged.clear()
    for group in staged_panels.values():
        group.covered = {i for i in group.covered if id(group.weights.params[i]) in packed}
    missing = set(params) - pushed
    if missing:
        stored = ((n, t) for n, t in iter_stored(model_dir) if n in missing)
        loaded = load_weights(model, stored, strict=False, source=model_dir)
        if missing - loaded:
            raise ModelLoadError(model_dir, f"missing tensor {sorted(missing - loaded)[0]!r}")
    copy_weights(model, shards)
    install_staged_panels(model, staged_panels, {id(p): p.data for p in params.values()})
    return bool(missing)


def _fits(
    tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> bool:
    return (
        tensor.shape == shape
        and tensor.dtype == dtype
        and tensor.device == device
        and tensor.is_contiguous()
    )


def apply_staged(model: CausalLM, staged: dict[str, torch.Tensor]) -> None:
    """Copy ``staged`` into resident parameters (a level-1 wakeup); consumes it."""
    named = list(staged.items())
    staged.clear()
    copy_weights(model, named)
