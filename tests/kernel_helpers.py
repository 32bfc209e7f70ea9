"""Switching the AVX-512 BF16 or AMX kernels for one test, and skipping where the CPU lacks
them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from tgengine import kernels
from tgengine.kernels import pair_panels
from tgengine.kernels.isa import isa
from tgengine.kernels.pair_panels import pair_panel_variants


def require_avx512_bf16() -> None:
    if "avx512_bf16" not in pair_panel_variants():
        pytest.skip(f"the AVX-512 BF16 kernels need a CPU with avx512_bf16 (this one: {isa()})")


def require_amx() -> None:
    if "amx" not in pair_panel_variants():
        pytest.skip(f"the AMX kernels need a CPU with AMX tiles for bf16 (this one: {isa()})")


@contextlib.contextmanager
def _switched(
    on: bool, require: Callable[[], None], get: Callable[[], bool], put: Callable[[bool], bool]
) -> Iterator[None]:
    if on:
        require()
    before = get()
    put(on)
    try:
        yield
    finally:
        put(before)


def avx512_bf16(on: bool) -> contextlib.AbstractContextManager[None]:
    """The AVX-512 BF16 kernels on (skips where the CPU has none) or off, then as before."""
    return _switched(on, require_avx512_bf16, kernels.avx512_bf16, kernels.set_avx512_bf16)


def amx(on: bool) -> contextlib.AbstractContextManager[None]:
    """The AMX kernels on (skips where the CPU has none) or off, then as before."""
    return _switched(on, require_amx, pair_panels.amx, pair_panels.set_amx)
