"""Other engines as bench peers, each in its own environment: vLLM (CPU) and llama.cpp."""

from .run import LimitsByThreads, PeerPlan, PeerRun, best_by_kind, run_peers
from .spec import (
    DEFAULT_THREADS,
    PeerRunError,
    PeerSpec,
    PeerSpecError,
    latency_job,
    memory_job,
    parse_peer,
    parse_threads,
    throughput_job,
    with_gguf,
)

__all__ = [
    "DEFAULT_THREADS",
    "LimitsByThreads",
    "PeerPlan",
    "PeerRun",
    "PeerRunError",
    "PeerSpec",
    "PeerSpecError",
    "best_by_kind",
    "latency_job",
    "memory_job",
    "parse_peer",
    "parse_threads",
    "run_peers",
    "throughput_job",
    "with_gguf",
]
