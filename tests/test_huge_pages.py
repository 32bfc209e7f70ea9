"""``runtime.huge_pages``: big buffers advised onto transparent huge pages, where Linux offers
them on request (``madvise`` mode); elsewhere plain ``torch.empty``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tgengine.runtime import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The flags of the mapping of this process holding ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_big_buffer_is_advised_onto_huge_pages() -> None:
    if not THP.exists() or "[madvise]" not in THP.read_text():
        pytest.skip("transparent huge pages are not in madvise mode here: nothing to ask")
    big = huge_pages.empty([8 << 20], torch.uint8)
    assert big.shape == (8 << 20,) and big.dtype == torch.uint8
    big.fill_(7)
    assert "hg" in vm_flags(big.data_ptr() + (4 << 20))  # MADV_HUGEPAGE on its mapping
    plain = torch.empty(8 << 20, dtype=torch.uint8)
    assert "hg" not in vm_flags(plain.data_ptr() + (4 << 20))


def test_small_buffers_and_the_switch_are_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    small = huge_pages.empty((3, 5), torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    assert huge_pages.empty(torch.Size([]), torch.float32).shape == ()  # a scalar's too
    huge_pages._madvise.cache_clear()
    monkeypatch.setenv("TGENGINE_HUGE_PAGES", "0")
    try:
        assert huge_pages._madvise() is None
    finally:
        monkeypatch.delenv("TGENGINE_HUGE_PAGES")
        huge_pages._madvise.cache_clear()
