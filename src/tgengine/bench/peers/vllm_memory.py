"""The ``memory`` job of ``vllm_driver.py``: vLLM's host memory and speed on one model.

Runs inside vLLM's environment (standard library, vllm and psutil, which vllm requires).
vLLM's CPU backend runs the model in processes of its own (the engine core, and the worker
its ``mp`` executor starts), so every figure is a sum over the driver and all its
descendants: RSS (what the table shows; pages shared between the processes, such as
torch's libraries, count once per process) and PSS (shared pages split between them). A
thread samples the sums every ``SAMPLE_S`` seconds and keeps the peak, so a peak shorter than
that can be missed. At most the job's batch runs at once, and a step takes at most
``max_num_batched_tokens`` (vLLM's start-up runs a dummy step of that many tokens: at its
default, 4096 on a 1B model at one thread, it took over 14 minutes here). The KV cache is
the job's ``kv_cache_bytes`` (vLLM's ``kv_cache_memory_bytes``; the caller unsets
``VLLM_CPU_KVCACHE_SPACE``, which would win).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

SAMPLE_S = 0.05


class TreeMemory:
    """RSS and PSS summed over this process and its descendants; peaks from a sampling thread."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self.peak_rss = 0
        self.peak_pss = 0
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def sample(self) -> tuple[int, int, int]:
        """(RSS, PSS, number of processes) now, and the peaks updated."""
        rss = pss = count = 0
        for process in [self._me, *self._me.children(recursive=True)]:
            try:
                info = process.memory_full_info()
            except (self._psutil.NoSuchProcess, self._psutil.ZombieProcess):
                continue  # it exited between the listing and the reading: it holds nothing
            rss += info.rss
            pss += info.pss
            count += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)
        self.max_processes = max(self.max_processes, count)
        return rss, pss, count

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def run_memory(
    job: dict[str, Any],
    start: Callable[..., tuple[Any, float]],
    warm_up: Callable[[Any, Any], None],
    generate: Callable[[Any, Any, list[dict[str, Any]]], tuple[float, int]],
    single: Callable[[Any, Any, dict[str, Any]], dict[str, float]],
) -> dict[str, Any]:
    """Load, then a batch and a single stream; the columns of ``bench memory``'s table.

    ``batch_tokens_per_s``: every batch prompt at once, ``max_tokens`` each, over the wall
    time (prefill included), as tgengine's row. ``decode_tokens_per_s``: the driver's
    single-stream figure, ``(k - 1) / (t_k - t_1)``.
    """
    memory = TreeMemory()
    base_rss, _, _ = memory.sample()
    import vllm

    imported_rss, _, _ = memory.sample()
    with memory:
        llm, startup_s = start(
            vllm,
            job,
            kv_cache_memory_bytes=job["kv_cache_bytes"],
            max_num_seqs=len(job["batch"]),
            max_num_batched_tokens=job["max_num_batched_tokens"],
        )
        loaded_rss, loaded_pss, processes = memory.sample()
        load_peak_rss, load_peak_pss = memory.peak_rss, memory.peak_pss
        warm_up(llm, vllm)
        k = job["max_tokens"]
        batch = [{"prompt": p, "max_tokens": k} for p in job["batch"]]
        wall, tokens = generate(llm, vllm, batch)
        one = single(llm, vllm, {"prompt": job["single"], "max_tokens": k})
    steady_rss, steady_pss, _ = memory.sample()
    return {
        "system": "vllm",
        "version": vllm.__version__,
        "startup_s": startup_s,
        "load_s": startup_s,
        "python_rss_bytes": base_rss,
        "base_rss_bytes": imported_rss,
        "load_peak_rss_bytes": load_peak_rss,
        "loaded_rss_bytes": loaded_rss,
        "peak_rss_bytes": memory.peak_rss,
        "steady_rss_bytes": steady_rss,
        "load_peak_pss_bytes": load_peak_pss,
        "loaded_pss_bytes": loaded_pss,
        "peak_pss_bytes": memory.peak_pss,
        "steady_pss_bytes": steady_pss,
        "processes": processes,
        "max_processes": memory.max_processes,
        "kv_cache_bytes": job["kv_cache_bytes"],
        "output_tokens": tokens,
        "batch_tokens_per_s": tokens / wall,
        "decode_tokens_per_s": one["decode_tokens_per_s"],
        "single_output_tokens": one["output_tokens"],
    }
