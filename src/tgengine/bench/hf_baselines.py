"""What a user would otherwise run: transformers ``generate`` and ``generate_batch``.

Every call here blocks (transformers is synchronous); the bench calls them outside any event
loop. Greedy, EOS ignored, the same prompt ids and per-request ``max_tokens`` as tgengine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from tqdm import tqdm

from .workload import BenchRequest


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def generation_config(model: Any, max_new_tokens: int) -> Any:
    """Greedy, exactly ``max_new_tokens`` new tokens (EOS never stops it)."""
    from transformers import GenerationConfig

    pad = model.config.pad_token_id
    if pad is None:
        pad = 0
    # No EOS: every request generates exactly max_new_tokens, as with ignore_eos.
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_static(
    model: Any, requests: list[BenchRequest], batch_size: int, *, progress: bool = True
) -> dict[str, Any]:
    """``generate`` on static batches of ``batch_size`` requests, in arrival order.

    Each batch is left-padded to its longest prompt and runs until its largest ``max_tokens``;
    only each request's own ``max_tokens`` tokens count as output (the rest is the waste a
    static batch pays).
    """
    device = model.device
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    useful = 0
    generated = 0
    bar = tqdm(
        total=len(requests),
        desc=f"hf generate bs={batch_size}",
        unit="req",
        disable=not progress,
        leave=False,
    )
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt) :] = 1
            max_new = max(r.max_tokens for r in batch)
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=generation_config(model, max_new),
            )
            generated += (out.shape[1] - width) * len(batch)
            useful += sum(min(r.max_tokens, out.shape[1] - width) for r in batch)
            bar.update(len(batch))
    _sync(device)
    wall = time.perf_counter() - start
    bar.close()
    return {
        "batch_size": batch_size,
        "wall_s": wall,
        "output_tokens": useful,
        "generated_tokens_incl_waste": generated,
    }


def generate_batch(
    model: Any, requests: list[BenchRequest], *, progress: bool = True
) -> dict[str, Any]:
    """transformers' continuous batching, each request with its own ``max_new_tokens``.

    This is what ``model.generate_batch`` runs (its manager, entered the same way), except
    that ``generate_batch`` takes one ``max_new_tokens`` for every request; the manager's
    ``add_request`` takes it per request, so the work matches tgengine's exactly. The manager's
    setup (cache allocation, warmup) is not timed, as tgengine's start is not.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    device = model.device
    config = generation_config(model, max(r.max_tokens for r in requests))
    config.eos_token_id = -1  # the manager's own spelling of "no EOS"
    logging.getLogger("transformers").setLevel(logging.ERROR)
    bar = tqdm(
        total=len(requests), desc="hf generate_batch", unit="req", disable=not progress, leave=False
    )
    # Its cache is sized from free memory, which on a CPU means all of RAM (it would zero
    # gigabytes first); give it room for every request at once instead: no preemption.
    page = ContinuousBatchingConfig.page_size
    pages = sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in requests)
    cb_config = ContinuousBatchingConfig(num_blocks=pages + 1)
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=30, continuous_batching_config=cb_config
    ) as manager:
        _sync(device)
        start = time.perf_counter()
        ids = [
            manager.add_request(input_ids=r.prompt, max_new_tokens=r.max_tokens, eos_token_id=-1)
            for r in requests
        ]
        pending = set(ids)
        tokens = 0
        errors = 0
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                tokens += len(result.generated_tokens)
                errors += result.error is not None
                bar.update(1)
        _sync(device)
        wall = time.perf_counter() - start
    bar.close()
    return {"wall_s": wall, "output_tokens": tokens, "num_errors": errors}


class _TimingStreamer:
    """A ``generate`` streamer that records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:  # generate first pushes the prompt
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def single_stream(model: Any, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """Batch-1 ``generate``: time to first token and decode tokens/s after it."""
    device = model.device
    ids = torch.tensor([prompt], device=device)
    streamer = _TimingStreamer()
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=generation_config(model, max_tokens),
            streamer=streamer,
        )
    _sync(device)
    times = streamer.times
    ttft = times[0] - start
    decode_s = times[-1] - times[0]
    return {
        "ttft_s": ttft,
        "decode_tokens_per_s": (len(times) - 1) / decode_s if decode_s > 0 else 0.0,
        "num_tokens": float(len(times)),
    }
