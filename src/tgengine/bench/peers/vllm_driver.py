"""Runs one bench job on vLLM, inside vLLM's own environment (its python, not tgengine's).

Usage: ``PYTHON vllm_driver.py RESULT.json < JOB.json``. It reads the job (see
``tgengine.bench.peers.spec``) from stdin, writes its result as JSON to RESULT.json and
exits 0; vLLM's own logging goes to stdout/stderr. It imports only the standard library and
vllm, so it runs in any environment that has vLLM and nothing of tgengine.

Prefix caching is off: the latency job generates each prompt twice. The thread binding
comes from the environment the caller sets (``VLLM_CPU_OMP_THREADS_BIND``).

The ``memory`` job (``bench memory``) also measures host memory: vLLM on CPU runs its engine
core (and its worker) in processes of their own, so memory is the sum over this process and
all its descendants (``vllm_memory.TreeMemory``, sampled in a thread), with the KV cache set
to the job's ``kv_cache_bytes``.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any


def _greedy(sampling_params: Any, max_tokens: int) -> Any:
    return sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm: Any, vllm: Any, requests: list[dict[str, Any]]) -> tuple[float, int]:
    """Every request at once; (wall seconds, output tokens)."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    params = [_greedy(vllm.SamplingParams, r["max_tokens"]) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outputs)


def _single(llm: Any, vllm: Any, request: dict[str, Any]) -> dict[str, float]:
    """TTFT = one request generating 1 token; decode rate from the same prompt generating
    ``max_tokens`` (the offline API reports no per-token times): (k - 1) / (t_k - t_1)."""
    first, _ = _generate(llm, vllm, [{**request, "max_tokens": 1}])
    k = request["max_tokens"]
    whole, num_tokens = _generate(llm, vllm, [request])
    decode_s = whole - first
    return {
        "ttft_s": first,
        "decode_tokens_per_s": (num_tokens - 1) / decode_s
        if num_tokens > 1 and decode_s > 0
        else 0.0,
        "output_tokens": float(num_tokens),
        "expected_tokens": float(k),
    }


def run(job: dict[str, Any]) -> dict[str, Any]:
    if job["mode"] == "memory":
        # Beside this file: on sys.path as the script's directory when run as a script.
        memory = importlib.import_module(
            f"{__package__}.vllm_memory" if __package__ else "vllm_memory"
        )
        return memory.run_memory(job, _start, _warm_up, _generate, _single)
    import vllm

    llm, startup_s = _start(vllm, job)
    _warm_up(llm, vllm)
    result: dict[str, Any] = {"system": "vllm", "version": vllm.__version__, "startup_s": startup_s}
    if job["mode"] == "throughput":
        wall, tokens = _generate(llm, vllm, job["requests"])
        result.update({"wall_s": wall, "output_tokens": tokens})
    else:
        result["single"] = {
            length: [_single(llm, vllm, r) for r in requests]
            for length, requests in job["singles"].items()
        }
    return result


def _warm_up(llm: Any, vllm: Any) -> None:
    """A few small generates, so that what is timed next is not vLLM's first of a shape."""
    warm = [{"prompt": list(range(16, 16 + n)), "max_tokens": 4} for n in (8, 24, 32)]
    _generate(llm, vllm, warm[:1])
    _generate(llm, vllm, warm)


def _start(vllm: Any, job: dict[str, Any], **kwargs: Any) -> tuple[Any, float]:
    """vLLM's ``LLM`` for the job's model, and the seconds its start took."""
    start = time.perf_counter()
    # No max_model_len: it is part of the key of vLLM's compile cache (as is the thread
    # binding), and the model's own keeps one cache entry per binding for every workload.
    llm = vllm.LLM(
        model=job["model"], dtype=job["dtype"], enable_prefix_caching=False, seed=0, **kwargs
    )
    return llm, time.perf_counter() - start


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} RESULT.json < JOB.json", file=sys.stderr)
        return 2
    job = json.load(sys.stdin)
    result = run(job)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
