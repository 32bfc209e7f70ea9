"""``bench parity``: greedy tokens of tgengine against transformers ``generate``, on any device.

The CPU float32 parity tests (``tests/test_parity.py``) require exact equality. On a GPU the
two run different kernels (cuBLAS, SDPA variants), so a near-tie between two logits may break
differently; this bench reports how many tokens match and where each prompt first diverges,
in float32 (TF32 off) and in the bench's dtype.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import torch

from ..open_engine import open_engine
from .common import BenchSetup
from .engine_run import engine_config, greedy
from .hf_baselines import generation_config, load_hf_model
from .throughput import _free
from .workload import BenchRequest, fixed_workload


def _hf_tokens(model: Any, request: BenchRequest) -> list[int]:
    ids = torch.tensor([request.prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=generation_config(model, request.max_tokens),
        )
    return [int(t) for t in out[0, len(request.prompt) :].tolist()]


async def _tg_tokens(
    setup: BenchSetup, dtype: str, requests: list[BenchRequest]
) -> list[list[int]]:
    config = engine_config(setup, dtype)
    async with open_engine(config) as engine:
        tokens: list[list[int]] = [[] for _ in requests]

        async def one(i: int) -> None:
            async for chunk in engine.generate(requests[i].prompt, greedy(requests[i].max_tokens)):
                tokens[i].extend(chunk.token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    return tokens


def _compare(ours: list[int], theirs: list[int]) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    return {
        "num_tokens": len(theirs),
        "matched_prefix": len(theirs) if first is None else first,
        "first_mismatch": first,
    }


def run_parity(
    setup: BenchSetup,
    *,
    prompt_lens: tuple[int, ...] = (5, 17, 64, 200),
    max_tokens: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy tokens, all prompts batched in tgengine, one by one in ``generate``."""
    mc = setup.model_config()
    requests = [
        fixed_workload(
            1,
            min(n, mc.max_position_embeddings - max_tokens - 1),
            max_tokens,
            mc.vocab_size,
            seed + i,
        )[0]
        for i, n in enumerate(prompt_lens)
    ]
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    rows: list[dict[str, Any]] = []
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        for dtype in dict.fromkeys(("float32", setup.dtype)):
            ours = anyio.run(partial(_tg_tokens, setup, dtype, requests))
            model = load_hf_model(setup.model_dir, getattr(torch, dtype), setup.device)
            theirs = [_hf_tokens(model, r) for r in requests]
            _free(model)
            for request, a, b in zip(requests, ours, theirs, strict=True):
                rows.append({"dtype": dtype, "prompt_len": len(request.prompt), **_compare(a, b)})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
    summary = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        total = sum(r["num_tokens"] for r in mine)
        summary[dtype] = {
            "exact": all(r["first_mismatch"] is None for r in mine),
            "matched_prefix_fraction": sum(r["matched_prefix"] for r in mine) / total
            if total
            else 0,
        }
    return {
        "bench": "parity",
        "workload": {"prompt_lens": [len(r.prompt) for r in requests], "max_tokens": max_tokens},
        "rows": rows,
        "summary": summary,
    }
