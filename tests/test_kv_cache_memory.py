"""The KV cache on a CPU: zero-filled, and resident only where sequences wrote.

Allocating it used to write every byte (``torch.zeros``), seconds of a start-up or a
``wakeup`` on a VM whose fresh pages are slow; an anonymous mapping costs nothing until used.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import psutil
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
    assert cache.kv.shape == (config.num_layers, 2, 28, config.num_kv_heads, config.head_dim)
    assert int(torch.count_nonzero(cache.kv)) == 0
    cache.kv[0, 0, 5] = 1.0
    assert float(cache.kv.sum()) == config.num_kv_heads * config.head_dim


def test_empty_shapes_are_allowed() -> None:
    assert zeroed((0, 3), torch.float32, torch.device("cpu")).shape == (0, 3)
