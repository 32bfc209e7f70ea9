"""This process's host memory: its resident set, and handing freed memory back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys

import torch


def process_rss() -> tuple[int, int]:
    """This process's resident set size now and its peak (Linux and macOS report the peak)."""
    import resource

    import psutil

    rss = int(psutil.Process().memory_info().rss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return rss, max(rss, int(peak))


def free_device_memory() -> None:
    """Collect garbage, empty the CUDA cache, and trim the host heap."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_host_heap()


def trim_host_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, and RSS stays high)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
