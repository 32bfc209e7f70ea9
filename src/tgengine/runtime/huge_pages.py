"""Big host buffers on transparent huge pages, where Linux gives them on request.

A buffer the engine fills right after allocating it (weights packed at a wakeup or as an
update's parts arrive, a part staged by copy) pays a page fault per 4 KiB the first time it
is written: for 257 MiB of weights, 65,000 faults, 4x the time of the copy itself on the
machines measured. Where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``
(the common default), ``madvise(MADV_HUGEPAGE)`` on the buffer before its first write makes
them 2 MiB faults instead (``empty``). ``TGENGINE_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import cast

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux") or os.environ.get("TGENGINE_HUGE_PAGES") == "0":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():
                return None  # always (nothing to ask) or never (nothing to get)
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


def advise(tensor: torch.Tensor) -> None:
    """Ask for huge pages under the 2 MiB-aligned part of a CPU tensor's memory; call it
    before the memory is first written (pages already there stay as they are)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return
    start = -(-tensor.data_ptr() // _HUGE) * _HUGE
    end = (tensor.data_ptr() + tensor.nbytes) // _HUGE * _HUGE
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # a refusal leaves small pages: fine


def empty(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``torch.empty(shape)`` whose pages, when first written, are huge where that is
    offered."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    if tensor.nbytes >= _HUGE:
        advise(tensor)
    return tensor
