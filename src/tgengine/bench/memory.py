"""``bench memory``: what a model costs in host memory, loaded by tgengine and by transformers.

The model is a synthetic 1B-class Llama (Llama-3.2-1B's shape, random bf16 weights written
by the bench in 1 GiB shards, ~2.5 GB). Each system loads it in a child process of its own,
so that the peak RSS while loading is that system's and nothing else's, and reports: the
process RSS after its imports, its peak while loading, its steady RSS after a batched step
and a batch-1 decode, and their speed. tgengine's steady RSS is compared with what
``memory_stats()`` says its weights and KV cache take.

Peers (``--peer vllm=PYTHON``: vLLM's CPU backend in its own environment) run after them on
the same model, prompts and decode tokens, with tgengine's KV cache size (``peers.memory_job``;
what they measure and how: ``peers/vllm_memory.py``). vLLM runs the model in processes of its
own, so its memory figures are sums over its process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .common import BenchSetup
from .memory_probe import BATCH_SIZE, PROMPT
from .peers import PeerPlan, memory_job, run_peers
from .synthetic import _byte_tokenizer

# Llama-3.2-1B's shape (tied embeddings): 1.24 B parameters, 2.47 GB in bf16.
LLAMA_1B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
_SHARD_BYTES = 1 << 30
# A peer's KV cache when tgengine did not run and --kv-cache-memory is not given.
_PEER_KV_BYTES = 1 << 30


def write_synthetic_1b(path: Path, shape: dict[str, Any] | None = None) -> Path:
    """Write a random Llama of ``shape`` (default ``LLAMA_1B``) as sharded bf16 safetensors."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**(shape or LLAMA_1B), dtype="bfloat16")
    with torch.device("meta"):
        names = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape_ in names.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "norm" in name:
            tensor = torch.ones(shape_, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape_, generator=generator) * 0.02).to(torch.bfloat16)
        if size and size + tensor.numel() * 2 > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(str(path))
    _byte_tokenizer(path)
    return path


def run_memory(
    setup: BenchSetup,
    *,
    model_dir: Path,
    systems: tuple[str, ...],
    decode_tokens: int,
    peers: PeerPlan | None = None,
) -> dict[str, Any]:
    """Each of ``systems`` in a child process, then each of ``peers`` at each of its threads."""
    rows = []
    for system in systems:
        args = [sys.executable, "-m", "tgengine.bench.memory_probe", system, str(model_dir)]
        args += [setup.dtype, str(setup.threads), str(decode_tokens)]
        if setup.kv_cache_memory:
            args.append(str(setup.kv_cache_memory))
        started = time.perf_counter()
        done = subprocess.run(args, check=True, capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["wall_s"] = time.perf_counter() - started
        row["threads"] = setup.threads
        rows.append(row)
    tg = next((r for r in rows if r["system"] == "tgengine"), None)
    peer_info = {}
    if peers is not None and peers.peers:
        kv = tg["kv_cache_bytes"] if tg else setup.kv_cache_memory or _PEER_KV_BYTES
        peer_info = _peer_rows(setup, peers, model_dir, decode_tokens, kv, rows)
    checkpoint = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    summary: dict[str, Any] = {"checkpoint_bytes": checkpoint}
    if tg is not None:
        budget = tg["weights_bytes"] + tg["kv_cache_bytes"]
        summary |= {
            "steady_over_weights_and_kv_bytes": tg["steady_rss_bytes"] - budget,
            "peak_over_steady": tg["peak_rss_bytes"] / tg["steady_rss_bytes"],
        }
    return {
        "bench": "memory",
        "workload": {"model": os.fspath(model_dir), "decode_tokens": decode_tokens},
        "rows": rows,
        "summary": summary,
        "peers": peer_info,
    }


def _peer_rows(
    setup: BenchSetup,
    plan: PeerPlan,
    model_dir: Path,
    decode_tokens: int,
    kv_cache_bytes: int,
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Each peer at each thread count, its row appended to ``rows``; what each peer run
    reported besides its figures (version, start-up time, or its error)."""
    info = {}
    for run in run_peers(
        plan,
        lambda threads: memory_job(
            os.fspath(model_dir),
            setup.dtype,
            threads,
            batch=[[*PROMPT, i] for i in range(BATCH_SIZE)],
            single=PROMPT,
            max_tokens=decode_tokens,
            kv_cache_bytes=kv_cache_bytes,
        ),
        progress=setup.progress,
    ):
        info[run.label] = run.info()
        if run.result is not None:
            rows.append(
                run.result | {"system": run.label, "peer": run.peer.kind, "threads": run.threads}
            )
    return info
