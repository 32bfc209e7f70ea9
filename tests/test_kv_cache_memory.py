"""The KV cache on a CPU: zero-filled, and resident only where sequences wrote.

Allocating it used to write every byte (``torch.zeros``), seconds of a start-up or a
``wakeup`` on a VM whose fresh pages are slow; an anonymous mapping costs nothing until used.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import psutil
import pytest
import torch

from tgengine.models import KVCache
from tgengine.models.kv_cache import zeroed

GIB = 1024**3


def _mappings_of_at_least(nbytes: int) -> int:
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            begin, end = (int(x, 16) for x in line.split()[0].split("-"))
            count += end - begin >= nbytes
    return count


def test_a_large_cpu_cache_is_zero_and_costs_no_memory_until_written() -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    heads = zeroed((4, 2, GIB // 16), torch.bfloat16, torch.device("cpu"))  # 1 GiB
    assert heads.shape == (4, 2, GIB // 16) and heads.dtype is torch.bfloat16
    assert process.memory_info().rss - before < 64 * 1024**2
    samples = heads[:, :, :: 4096 * 64]  # one element in every 64th page
    assert int(torch.count_nonzero(samples)) == 0
    heads[3, 1, -5:] = 1.5  # writable to the last element
    assert heads[3, 1, -6:].tolist() == [0.0, 1.5, 1.5, 1.5, 1.5, 1.5]
    assert process.memory_info().rss - before < 64 * 1024**2


def test_the_mapping_goes_with_the_last_view() -> None:
    before = _mappings_of_at_least(GIB)
    heads = zeroed((GIB // 2,), torch.float16, torch.device("cpu"))
    view = heads.view(2, -1).permute(1, 0)
    del heads
    gc.collect()
    assert _mappings_of_at_least(GIB) == before + 1
    probe = weakref.ref(view.untyped_storage())
    del view
    gc.collect()
    assert probe() is None
    assert _mappings_of_at_least(GIB) == before


def test_allocate_keeps_its_layout_on_the_lazy_memory(tmp_path: Path) -> None:
    from tgengine.models import load_model_config

    from model_factory import make_tiny_model_dir

    config = load_model_config(make_tiny_model_dir(tmp_path / "m", "llama"))
    cache = KVCache.allocate(config, 7, 4, torch.float32, "cpu")
    heads, dim = config.num_kv_heads, config.head_dim
    assert cache.kv.shape == (config.num_layers, 2, heads, 7, 4, dim)
    assert cache.num_blocks == 7 and cache.nbytes == 7 * KVCache.bytes_per_block(
        config, 4, torch.float32
    )
    assert int(torch.count_nonzero(cache.kv)) == 0
    cache.kv[0, 0, :, 5, 1] = 1.0
    assert float(cache.kv.sum()) == heads * dim
    # Block-major: a block (every layer, keys and values, every head) is one span.
    block = cache.kv[:, :, :, 3]
    assert cache.kv.stride(3) == block.numel()
    assert cache.layer_heads(1).shape == (2, heads, 7, 4, dim)
    assert cache.layer_heads(1).stride()[3:] == (dim, 1)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").is_dir(), reason="a kernel without THP"
)
def test_the_cache_asks_for_huge_pages_on_a_2_mib_boundary() -> None:
    """Decode attention reads blocks scattered over the cache: with 4 KiB pages nearly every
    block is a TLB miss. The mapping starts on a huge page and is marked for THP (``hg``)."""
    heads = zeroed((4, 2, GIB // 64), torch.bfloat16, torch.device("cpu"))
    assert heads.data_ptr() % (2 << 20) == 0
    assert "hg" in _vm_flags(heads.data_ptr())
    heads[1, 1, 7] = 2.0
    assert float(heads.sum()) == 2.0


def test_a_first_request_makes_little_of_the_cache_resident(tmp_path: Path) -> None:
    """With huge pages, a layout that spread a block over every layer and head made a short
    first request fault in a huge page per layer and head (360 MiB and 0.9 s for SmolLM2, again
    after each wakeup). Block-major, its one block is one span: a huge page or two."""
    from tgengine.models import load_model_config
    from tgengine.models.attention import write_kv

    from model_factory import make_tiny_model_dir

    config = load_model_config(make_tiny_model_dir(tmp_path / "m", "llama", num_hidden_layers=30))
    per_block = KVCache.bytes_per_block(config, 16, torch.bfloat16)
    cache = KVCache.allocate(config, GIB // 2 // per_block, 16, torch.bfloat16, "cpu")
    process = psutil.Process()
    before = process.memory_info().rss
    slots = torch.arange(8, dtype=torch.int64) + 5 * 16  # 8 tokens in block 5
    new = torch.ones(8, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16)
    for layer in range(config.num_layers):
        write_kv(cache.layer_heads(layer), slots, new, new)
    assert process.memory_info().rss - before < 16 * 1024**2
    assert float(cache.kv[:, :, :, 5].sum()) == 2 * 30 * 8 * config.num_kv_heads * config.head_dim


def test_empty_shapes_are_allowed() -> None:
    assert zeroed((0, 3), torch.float32, torch.device("cpu")).shape == (0, 3)
