"""The checks every pushed weight passes before anything is applied."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import InvalidRequestError

WeightSpecs = dict[str, tuple[torch.Size, torch.dtype]]


def check_named(
    specs: WeightSpecs, named: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """``named`` without what is skipped, once every tensor fits ``specs``.

    Names and full shapes are strict; a floating tensor of another float dtype is cast later
    (another kind of dtype is refused). A tied model's ``lm_head.weight`` (the embedding
    under another name; ``specs`` lacks it) is skipped. Raises ``InvalidRequestError``
    naming the tensor.
    """
    kept: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if name == "lm_head.weight" and name not in specs:
            continue
        if name not in specs:
            raise InvalidRequestError("weights", f"unknown tensor name {name!r}")
        shape, dtype = specs[name]
        if tuple(tensor.shape) != tuple(shape):
            raise InvalidRequestError(
                "weights", f"{name}: shape {tuple(tensor.shape)} != expected {tuple(shape)}"
            )
        if tensor.dtype != dtype and not (tensor.is_floating_point() and dtype.is_floating_point):
            raise InvalidRequestError("weights", f"{name}: dtype {tensor.dtype} != {dtype}")
        kept.append((name, tensor))
    return kept


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Refuse a floating tensor holding a NaN or an infinity (a diverged trainer's)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return
    # one vectorised pass, no temporary: a NaN propagates into both ends, an infinity shows
    # (isfinite().all() is 20x slower on a bfloat16 CPU tensor)
    low, high = torch.aminmax(tensor)
    if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
        raise InvalidRequestError("weights", f"{name}: holds NaN or infinite values")
