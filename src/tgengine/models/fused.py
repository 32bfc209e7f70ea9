"""Several parameters as row blocks of one tensor, so that one GEMM computes several linears.

The parameters keep their names, shapes and dtypes (checkpoints, ``weight_specs`` and weight
updates see nothing new); only their storage is shared. Whoever owns the weights may still
replace a parameter's ``.data`` (sleep, wakeup, a reload) or copy into it in place (a weight
update): an in-place copy writes into the shared buffer, and a replaced parameter breaks the
sharing, which the next ``fused_rows`` call notices and repairs with one copy. No reference to
the shared buffer is kept outside the parameters, so dropping them frees it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fused_rows(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor whose consecutive row blocks are ``params`` (concatenated along dim 0).

    Cheap when they already share one buffer in that order (a view of it); otherwise it copies
    them into a new buffer and points each parameter's ``.data`` at its block first.
    """
    first = params[0]
    total = sum(int(p.shape[0]) for p in params)
    shape = (total, *first.shape[1:])
    if _share_buffer(params):
        return first.as_strided(shape, first.stride(), first.storage_offset())
    with torch.inference_mode(False), torch.no_grad():
        buffer = torch.cat([p.detach() for p in params])
        offset = 0
        for p in params:
            rows = int(p.shape[0])
            p.data = buffer[offset : offset + rows]
            offset += rows
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _share_buffer(params: Sequence[torch.Tensor]) -> bool:
    first = params[0]
    if not first.is_contiguous() or first.numel() == 0:
        return False
    base = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for p in params:
        if (
            p.data_ptr() != expected
            or not p.is_contiguous()
            or p.dtype != first.dtype
            or p.device != first.device
            or p.shape[1:] != first.shape[1:]
            or p.untyped_storage().data_ptr() != base
        ):
            return False
        expected += p.numel() * p.element_size()
    return True
