"""``EngineConfig``: what to run and how much memory to use. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXECUTORS = ("uni", "mp", "ray")
QUANTIZATIONS = ("int8",)
TOKENIZER_MODES = ("auto", "hf")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine; validated on construction (``ValueError`` names the field).

    ``num_blocks`` wins over ``kv_cache_memory``. Without either, the KV cache takes
    ``gpu_memory_utilization`` of free memory on CUDA, and a fixed 512 MiB budget on CPU.
    ``num_threads`` sets torch's CPU threads (process-wide); on CPU it defaults to the
    count that runs a decode-like step fastest here, measured once per process (0.15 s per
    candidate; see ``cpu_threads``). ``prepack_weights``: on
    CPU, where oneDNN packs the dtype, replace each linear weight by its packed form
    (faster products; still one copy of the weights, see docs/engine.md).
    ``quantization``: ``"int8"`` quantizes the linear weights of a bf16/fp16 model on CPU
    to int8, one scale per output row (weight-only: activations and the KV cache keep the
    dtype; half the bytes per decode step; needs ``prepack_weights``). See docs/quantization.md.
    ``tokenizer_mode``: ``"auto"`` runs the directory's ``tokenizer.json`` with the tokenizers
    library where transformers would run it as it is (no transformers import at start-up),
    else transformers' ``AutoTokenizer``; ``"hf"``: always ``AutoTokenizer``. See docs/engine.md.

    ``tensor_parallel_size`` ranks each hold a shard of the model; ``executor`` runs them:
    ``"uni"`` (one rank, in this process), ``"mp"`` (one worker process per rank) or
    ``"ray"`` (one Ray actor per rank); None picks ``uni`` at size 1 and ``mp`` above.
    ``ray_address`` is the Ray cluster to join (None: start or join a local one); only
    the ``ray`` executor reads it. See docs/distributed.md. ``ray_placement_strategy``: how
    Ray places the ranks' bundles (``"PACK"``: as few nodes as fit; ``"STRICT_SPREAD"``:
    one rank per node; also ``"SPREAD"``, ``"STRICT_PACK"``).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    step_timeout: float | None = None
    when_asleep: Literal["reject", "wait"] = "reject"
    seed: int = 0
    gpu_memory_utilization: float = 0.85
    tokenizer: str | None = None
    tokenizer_mode: Literal["auto", "hf"] = "auto"
    num_threads: int | None = None
    prepack_weights: bool = True
    quantization: Literal["int8"] | None = None
    tensor_parallel_size: int = 1
    executor: Literal["uni", "mp", "ray"] | None = None
    ray_address: str | None = None
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must name a model directory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.step_timeout is not None and not self.step_timeout > 0:
            raise ValueError(f"step_timeout: must be > 0 seconds, got {self.step_timeout}")
        if self.when_asleep not in ("reject", "wait"):
            raise ValueError(f"when_asleep: must be 'reject' or 'wait', got {self.when_asleep!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"quantization: must be one of {QUANTIZATIONS} or None, "
                    f"got {self.quantization!r}"
                )
            if not self.prepack_weights:
                raise ValueError("quantization: int8 weights are packed; needs prepack_weights")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode: must be one of {TOKENIZER_MODES}, got {self.tokenizer_mode!r}"
            )
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ValueError(f"executor: must be one of {EXECUTORS} or None, got {self.executor!r}")
        if self.executor == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"executor: 'uni' runs one rank; tensor_parallel_size="
                f"{self.tensor_parallel_size} needs 'mp' or 'ray'"
            )
        if self.ray_address is not None and not self.ray_address:
            raise ValueError("ray_address: must be an address (or 'auto'), or None")
        if self.ray_placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy: must be one of {PLACEMENT_STRATEGIES}, "
                f"got {self.ray_placement_strategy!r}"
            )

    @property
    def executor_kind(self) -> Literal["uni", "mp", "ray"]:
        """The executor that runs the ranks: ``executor``, or the default for the size."""
        if self.executor is not None:
            return self.executor
        return "uni" if self.tensor_parallel_size == 1 else "mp"


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
