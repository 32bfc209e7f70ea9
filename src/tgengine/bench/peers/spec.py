"""Which peers a bench runs (``--peer``), at which threads, and the job each one is given.

A job is plain JSON, the same for every peer: the model directory, dtype, thread count, and
the requests as token-id prompts with their ``max_tokens``. ``mode`` says what to measure:
``throughput`` (every request at once; wall time and output tokens), ``latency`` (one
stream at a time: time to first token and decode tokens/s, per prompt length) or ``memory``
(``bench memory``'s columns: host memory while loading and after, a batch, a single stream;
vLLM only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from ..workload import BenchRequest

PEER_KINDS = ("vllm", "llamacpp")
PeerKind = Literal["vllm", "llamacpp"]
# A peer's own default thread setting (vLLM: VLLM_CPU_OMP_THREADS_BIND=auto).
DEFAULT_THREADS: Final = "default"
Threads = int | Literal["default"]


class PeerSpecError(ValueError):
    """A ``--peer`` / ``--peer-threads`` value that cannot be used; the message says why."""


class PeerRunError(RuntimeError):
    """A peer failed to run its job; the message carries the tail of its log."""


def log_tail(path: Path, num_chars: int = 3000) -> str:
    """The end of a peer's log file (empty when it wrote none)."""
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except FileNotFoundError:
        return ""


@dataclass(frozen=True)
class PeerSpec:
    """One peer: ``vllm`` with the python of its environment, or ``llamacpp`` with its
    ``llama-server`` and the GGUF file it serves."""

    kind: PeerKind
    executable: str
    gguf: str | None = None

    def check(self) -> None:
        """Raise ``PeerSpecError`` when the executable (or llama.cpp's GGUF) is missing."""
        if not os.access(self.executable, os.X_OK):
            raise PeerSpecError(f"{self.kind}: {self.executable} is not an executable file")
        if self.kind == "llamacpp":
            if self.gguf is None:
                raise PeerSpecError(
                    "llamacpp: needs a GGUF file: --peer llamacpp=SERVER,GGUF or --peer-gguf"
                )
            if not Path(self.gguf).is_file():
                raise PeerSpecError(f"llamacpp: GGUF {self.gguf} does not exist")

    def label(self, threads: Threads) -> str:
        """The row name: ``vllm t=2``, ``llamacpp default``."""
        return (
            f"{self.kind} {threads}" if threads == DEFAULT_THREADS else f"{self.kind} t={threads}"
        )


def parse_peer(text: str) -> PeerSpec:
    """``vllm=PYTHON``, ``llamacpp=SERVER`` or ``llamacpp=SERVER,GGUF``."""
    kind, sep, rest = text.partition("=")
    kind = kind.strip()
    if not sep or not rest.strip():
        raise PeerSpecError(f"expected KIND=PATH with KIND in {PEER_KINDS}, got {text!r}")
    if kind == "vllm":
        return PeerSpec("vllm", rest.strip())
    if kind == "llamacpp":
        server, _, gguf = rest.partition(",")
        return PeerSpec("llamacpp", server.strip(), gguf.strip() or None)
    raise PeerSpecError(f"unknown peer {kind!r}: choose from {', '.join(PEER_KINDS)}")


def with_gguf(peers: list[PeerSpec], gguf: str | None) -> list[PeerSpec]:
    """Give ``gguf`` (``--peer-gguf``) to each llama.cpp peer that names none itself."""
    if gguf is None:
        return peers
    return [
        PeerSpec(p.kind, p.executable, gguf) if p.kind == "llamacpp" and p.gguf is None else p
        for p in peers
    ]


def parse_threads(text: str) -> tuple[Threads, ...]:
    """``1,2`` or ``default,2``: the thread counts every peer is measured at."""
    values: list[Threads] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == DEFAULT_THREADS:
            values.append(DEFAULT_THREADS)
            continue
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n <= 0:
            raise PeerSpecError(f"peer threads: positive integers or 'default', got {text!r}")
        values.append(n)
    if not values:
        raise PeerSpecError(f"peer threads: none given in {text!r}")
    return tuple(dict.fromkeys(values))


def _requests(requests: list[BenchRequest]) -> list[dict[str, Any]]:
    return [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in requests]


def throughput_job(
    model_dir: str, dtype: str, threads: Threads, requests: list[BenchRequest]
) -> dict[str, Any]:
    """Every request submitted at once; the peer reports ``wall_s`` and ``output_tokens``."""
    return {
        "mode": "throughput",
        "model": model_dir,
        "dtype": dtype,
        "threads": threads,
        "max_model_len": max(len(r.prompt) + r.max_tokens for r in requests) + 1,
        "requests": _requests(requests),
    }


def latency_job(
    model_dir: str, dtype: str, threads: Threads, singles: dict[int, list[BenchRequest]]
) -> dict[str, Any]:
    """One request at a time; the peer reports, per prompt length, each request's
    ``ttft_s`` and ``decode_tokens_per_s``."""
    every = [r for requests in singles.values() for r in requests]
    return {
        "mode": "latency",
        "model": model_dir,
        "dtype": dtype,
        "threads": threads,
        "max_model_len": max(len(r.prompt) + r.max_tokens for r in every) + 1,
        "singles": {str(n): _requests(requests) for n, requests in singles.items()},
    }


# The most tokens a step of the memory job takes (prefill is chunked to it).
_MEMORY_STEP_TOKENS = 256


def memory_job(
    model_dir: str,
    dtype: str,
    threads: Threads,
    *,
    batch: list[list[int]],
    single: list[int],
    max_tokens: int,
    kv_cache_bytes: int,
) -> dict[str, Any]:
    """``batch`` at once and then ``single`` alone, ``max_tokens`` each, with a KV cache of
    ``kv_cache_bytes``; the peer reports ``bench memory``'s row (``vllm_memory.py``)."""
    return {
        "mode": "memory",
        "model": model_dir,
        "dtype": dtype,
        "threads": threads,
        "max_model_len": max(len(p) for p in [*batch, single]) + max_tokens + 1,
        "batch": batch,
        "single": single,
        "max_tokens": max_tokens,
        "kv_cache_bytes": kv_cache_bytes,
        "max_num_batched_tokens": _MEMORY_STEP_TOKENS,
    }
