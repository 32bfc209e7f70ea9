"""Child process of ``bench memory``: load one system, measure it, print one JSON line.

``python -m tgengine.bench.memory_probe SYSTEM MODEL_DIR DTYPE THREADS DECODE_TOKENS [KV_BYTES]``
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import torch

from ..agent.host_memory import process_rss
from ..config import EngineConfig
from ..open_engine import open_engine
from ..sampling import SamplingParams

BATCH_SIZE = 8
PROMPT = list(range(100, 164))


async def _tgengine(
    model_dir: str, dtype: str, threads: int, tokens: int, kv: int | None
) -> dict[str, Any]:
    base, _ = process_rss()
    config = EngineConfig(
        model=model_dir, dtype=dtype, device="cpu", num_threads=threads, kv_cache_memory=kv
    )
    started = time.perf_counter()
    async with open_engine(config) as engine:
        load_s = time.perf_counter() - started
        _, load_peak = process_rss()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        begin = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(BATCH_SIZE):
                tg.start_soon(_drain, engine.generate([*PROMPT, i], params))
        batch_tps = BATCH_SIZE * tokens / (time.perf_counter() - begin)
        first = None
        begin = time.perf_counter()
        async for _chunk in engine.generate(PROMPT, params):
            first = first or time.perf_counter()
        decode_tps = (tokens - 1) / (time.perf_counter() - (first or begin))
        stats = next(iter(engine.memory_stats().values()))
        steady, peak = process_rss()
    return {
        "system": "tgengine",
        "base_rss_bytes": base,
        "load_s": load_s,
        "load_peak_rss_bytes": load_peak,
        "peak_rss_bytes": peak,
        "steady_rss_bytes": steady,
        "weights_bytes": stats.weights_bytes,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "batch_tokens_per_s": batch_tps,
        "decode_tokens_per_s": decode_tps,
    }


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def _transformers(model_dir: str, dtype: str, threads: int, tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    base, _ = process_rss()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - started
    _, load_peak = process_rss()
    kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
    with torch.inference_mode():
        batch = torch.tensor([[*PROMPT, i] for i in range(BATCH_SIZE)])
        begin = time.perf_counter()
        model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
        batch_tps = BATCH_SIZE * tokens / (time.perf_counter() - begin)
        one = torch.tensor([PROMPT])
        begin = time.perf_counter()
        model.generate(one, attention_mask=torch.ones_like(one), **kwargs)
        decode_tps = tokens / (time.perf_counter() - begin)
    steady, peak = process_rss()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "system": "transformers",
        "base_rss_bytes": base,
        "load_s": load_s,
        "load_peak_rss_bytes": load_peak,
        "peak_rss_bytes": peak,
        "steady_rss_bytes": steady,
        "weights_bytes": weights,
        "kv_cache_bytes": 0,
        "batch_tokens_per_s": batch_tps,
        "decode_tokens_per_s": decode_tps,
    }


def main(argv: list[str]) -> None:
    system, model_dir, dtype, threads, tokens = argv[:5]
    kv = int(argv[5]) if len(argv) > 5 else None
    if system == "tgengine":
        row = anyio.run(_tgengine, model_dir, dtype, int(threads), int(tokens), kv)
    else:
        row = _transformers(model_dir, dtype, int(threads), int(tokens))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
