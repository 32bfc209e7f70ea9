"""The CPU's instruction set, as one label: what a bench figure was measured on, and which
kernel variants apply here.

``isa()`` is the best of ``amx`` (AMX tiles for bf16), ``avx512_bf16`` (AVX-512 with
``vdpbf16ps``), ``avx512`` (AVX-512F), ``avx2``, read from the flags in ``/proc/cpuinfo``;
where there is no such file, torch's own view (``torch.backends.cpu.get_cpu_capability()``,
lower-cased: ``avx2``, ``avx512``, ``default``...). A figure measured on one label says
little about another: oneDNN's bf16 products run natively from ``avx512_bf16`` up and are
emulated below it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch

ISAS = ("amx", "avx512_bf16", "avx512", "avx2")
"""The labels, best first (anything else: torch's capability, lower-cased)."""

_NEEDS = {
    "amx": ("amx_bf16", "amx_tile", "avx512_bf16"),
    "avx512_bf16": ("avx512f", "avx512bw", "avx512_bf16"),
    "avx512": ("avx512f", "avx512bw"),
    "avx2": ("avx2", "fma", "f16c"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return parse_flags(text)


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of a ``/proc/cpuinfo`` text, as a set."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_of(flags: Iterable[str]) -> str | None:
    """The best label whose flags are all in ``flags``, or None."""
    have = set(flags)
    for label in ISAS:
        if all(flag in have for flag in _NEEDS[label]):
            return label
    return None


def isa() -> str:
    """This machine's label (see the module's docstring)."""
    return isa_of(cpu_flags()) or torch.backends.cpu.get_cpu_capability().lower()
