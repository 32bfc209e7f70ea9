"""The machine's limits, measured here, and what the model costs per token.

``measure_machine`` times a sustained GEMM (the matrix-product rate) and a large reduction and
copy (memory bandwidth) on the bench's device, dtype and threads. ``ModelCosts`` counts the
model's FLOPs and bytes per token from its config. Together they give two floors: the compute
floor of a workload (its FLOPs at the measured GEMM rate: what a large batch can at best
reach) and the memory floor of batch-1 decode (weights plus KV read once per token at the
measured bandwidth).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from ..agent.cpu_threads import fastest_thread_count
from ..models import ModelConfig
from ..runtime.openmp_policy import release_openmp_threads
from .workload import BenchRequest

# Sustained, not burst: a shared or throttled machine shows its real rate only after a while.
_MEASURE_SECONDS = 1.5

GemmCase = tuple[int, int, int, str]  # m, n, k and the operands' dtype (its torch name)


@dataclass(frozen=True)
class MachineLimits:
    device: str
    dtype: str
    threads: int
    matmul_flops: float  # FLOP/s, best sustained GEMM
    memory_bandwidth: float  # bytes/s, best of a read (sum) and a copy (read + write)
    matmul_detail: dict[str, float]
    bandwidth_detail: dict[str, float]
    matmul_case: GemmCase  # the GEMM that gave matmul_flops (``matmul_now`` times it again)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(fn: Callable[[], object], work: float, device: torch.device, seconds: float) -> float:
    """``work`` units per second of ``fn``, run repeatedly for about ``seconds``."""
    fn()
    _sync(device)
    count = 0
    start = time.perf_counter()
    while True:
        fn()
        count += 1
        if count % 4 == 0 or device.type != "cuda":
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                # This thread runs no forward: its OpenMP team would slow the engine's.
                release_openmp_threads()
                return work * count / elapsed


def _gemm_shapes(
    device: torch.device, hidden: int, intermediate: int, quick: bool
) -> dict[str, tuple[int, int, int]]:
    if device.type == "cuda":
        return {"square 8192": (8192, 8192, 8192), "mlp m=8192": (8192, 2 * intermediate, hidden)}
    if quick:
        return {"square 512": (512, 512, 512)}
    return {"square 2048": (2048, 2048, 2048), "mlp m=512": (512, 2 * intermediate, hidden)}


def _gemm_cases(
    device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, quick: bool
) -> dict[str, GemmCase]:
    """The GEMMs ``measure_machine`` times, by label.

    Half-precision weights may be multiplied in float32 where that is faster (CPUs without
    native bf16 products, see models.gemm): each shape is timed in float32 too, and the
    floor is the fastest case.
    """
    dtypes = [dtype]
    if device.type == "cpu" and dtype != torch.float32:
        dtypes.append(torch.float32)
    cases = {}
    for name, (m, n, k) in _gemm_shapes(device, hidden, intermediate, quick).items():
        for kind in dtypes:
            cases[name if kind == dtype else f"{name} in float32"] = (m, n, k, _name(kind))
    return cases


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gemm_rate(device: torch.device | str, case: GemmCase, seconds: float) -> float:
    """FLOP/s of one sustained GEMM ``case`` (at the current threads)."""
    device = torch.device(device)
    m, n, k, name = case
    kind = getattr(torch, name)
    with torch.inference_mode():
        a = torch.randn(m, k, device=device).to(kind)
        b = torch.randn(n, k, device=device).to(kind)
        return _rate(partial(torch.matmul, a, b.T), 2.0 * m * n * k, device, seconds)


def measure_machine(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    hidden: int = 576,
    intermediate: int = 1536,
    quick: bool = False,
) -> MachineLimits:
    """Measure the GEMM rate and memory bandwidth on ``device`` in ``dtype`` (current threads).

    Each figure is the best of a sustained run (about 1.5 s; ``quick``: 0.1 s on small sizes,
    for smoke tests only).
    """
    device = torch.device(device)
    seconds = measure_seconds(quick)
    cases = _gemm_cases(device, dtype, hidden, intermediate, quick)
    matmul = {label: gemm_rate(device, case, seconds) for label, case in cases.items()}
    best = max(matmul, key=lambda label: matmul[label])
    with torch.inference_mode():
        size = (1 << 30) if device.type == "cuda" else (512 << 20)
        if quick:
            size = 32 << 20
        x = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        bandwidth = {
            "read (sum)": _rate(lambda: x.sum(), float(size), device, seconds),
            "copy (read + write)": _rate(lambda: y.copy_(x), 2.0 * size, device, seconds),
        }
    return MachineLimits(
        device=str(device),
        dtype=_name(dtype),
        threads=torch.get_num_threads(),
        matmul_flops=matmul[best],
        memory_bandwidth=max(bandwidth.values()),
        matmul_detail=matmul,
        bandwidth_detail=bandwidth,
        matmul_case=cases[best],
    )


def measure_seconds(quick: bool) -> float:
    return 0.1 if quick else _MEASURE_SECONDS


def pick_threads(requested: str | int | None, dtype: torch.dtype) -> tuple[int, dict[str, float]]:
    """The CPU thread count to run with: ``requested``, or the fastest here (``auto``).

    ``auto`` is ``cpu_threads.fastest_thread_count`` with half-second rounds.
    """
    if requested not in (None, "auto"):
        return int(requested), {}
    try:
        return fastest_thread_count(dtype, 0.5)
    finally:
        release_openmp_threads()  # as measure_machine


@dataclass(frozen=True)
class ModelCosts:
    """What one token costs the model, counted from its config."""

    num_params: int
    layer_matmul_params: int  # weights every token multiplies by (all decoder layers; MoE: top_k)
    head_params: int  # the LM head, paid by tokens whose logits are computed
    weight_bytes: int  # bytes of all weights a decode step reads (layers, norms, head)
    kv_bytes_per_token: int  # K and V of one context token, all layers
    attention_flops_per_key: int  # FLOPs of one (query, key) pair, all layers

    @staticmethod
    def of(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> ModelCosts:
        """``quantization="int8"``: the matrix weights (layers and head) take a byte each."""
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_heads * d, config.num_kv_heads * d
        bias = (q + 2 * kv) if config.attention_bias else 0
        attention = h * (q + 2 * kv) + q * h
        dense = 3 * h * config.intermediate_size
        moe = config.moe
        sparse = sum(moe.sparse_layers) if moe is not None else 0
        # Every layer's weights are stored; a token multiplies by its top_k experts only.
        layers = config.num_layers * attention + (config.num_layers - sparse) * dense
        active = layers
        if moe is not None:
            expert = 3 * h * moe.intermediate_size
            router = h * moe.num_experts
            layers += sparse * (router + moe.num_experts * expert)
            active += sparse * (router + moe.top_k * expert)
        norms = config.num_layers * 2 * h + h
        head = config.vocab_size * h
        embed = 0 if config.tie_word_embeddings else config.vocab_size * h
        element = torch.empty((), dtype=dtype).element_size()
        matrix = 1 if quantization == "int8" else element
        return ModelCosts(
            num_params=layers + config.num_layers * bias + norms + head + embed,
            layer_matmul_params=active,
            head_params=head,
            weight_bytes=(layers + head) * matrix + (config.num_layers * bias + norms) * element,
            kv_bytes_per_token=config.num_layers * 2 * kv * element,
            attention_flops_per_key=config.num_layers * 4 * q,
        )

    def flops_per_token(self, context_len: int = 0) -> int:
        """A decode token at ``context_len``: ~2 x params, plus attention over the context."""
        return 2 * (self.layer_matmul_params + self.head_params) + (
            self.attention_flops_per_key * context_len
        )

    def bytes_per_token(self, context_len: int = 0) -> int:
        """What batch-1 decode must read per token: every weight, plus the context's KV."""
        return self.weight_bytes + self.kv_bytes_per_token * context_len

    def workload_flops(self, requests: list[BenchRequest]) -> int:
        """The FLOPs any engine must spend: every prompt and output token once, no padding."""
        total = 0
        for r in requests:
            num_computed = len(r.prompt) + r.max_tokens - 1  # the last token is never fed back
            pairs = num_computed * (num_computed + 1) // 2  # causal (query, key) pairs
            total += 2 * self.layer_matmul_params * num_computed
            total += 2 * self.head_params * r.max_tokens
            total += self.attention_flops_per_key * pairs
        return total

    def workload_bytes(self, requests: list[BenchRequest]) -> int:
        """The bytes any engine must read from memory: the weights once per forward, for
        the fewest forwards the workload allows (its longest output: one forward per token,
        every prompt in the first), and each output token's context KV once (the token the
        prompt's forward samples reads none: its keys are computed there)."""
        if not requests:
            return 0
        forwards = max(r.max_tokens for r in requests)
        kv_tokens = 0
        for r in requests:
            p, n = len(r.prompt), r.max_tokens - 1  # decode forwards, contexts p + 1 .. p + n
            kv_tokens += n * p + n * (n + 1) // 2
        return forwards * self.weight_bytes + kv_tokens * self.kv_bytes_per_token

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "flops_per_token": self.flops_per_token()}


def compute_floor(
    costs: ModelCosts,
    limits: MachineLimits,
    requests: list[BenchRequest],
    wall_s: float,
    around: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The workload's FLOPs at the measured GEMM rate, and the fraction of it a run reached;
    beside it the roofline floor: the longer of that and the workload's bytes
    (``ModelCosts.workload_bytes``) at the measured memory rate.

    The compute floor alone is out of reach where decoding is bound by memory (on AMX the
    GEMM rate is 5-10x what a decode step's reads allow); the roofline floor is what no
    engine can beat on either count.

    ``around``: the GEMM rate measured just before and just after the run (``BenchSetup.around``);
    the floor then takes their mean, the machine's rate while the run went on, instead of
    ``limits``' (measured once, at the bench's start). On a shared machine the rate drifts by
    tens of percent within minutes, more than the runs compared differ.
    """
    flops = costs.workload_flops(requests)
    rate = limits.matmul_flops if around is None else sum(around) / 2
    floor_s = flops / rate
    workload_bytes = costs.workload_bytes(requests)
    memory_s = workload_bytes / limits.memory_bandwidth
    roofline_s = max(floor_s, memory_s)
    found: dict[str, Any] = {
        "workload_flops": float(flops),
        "compute_floor_s": floor_s,
        "compute_floor_matmul_flops": rate,
        "achieved_flops": flops / wall_s if wall_s > 0 else 0.0,
        "fraction_of_compute_floor": floor_s / wall_s if wall_s > 0 else 0.0,
        "workload_bytes": float(workload_bytes),
        "memory_floor_s": memory_s,
        "roofline_floor_s": roofline_s,
        "fraction_of_roofline_floor": roofline_s / wall_s if wall_s > 0 else 0.0,
    }
    if around is not None:
        found["matmul_flops_before_after"] = list(around)
    return found


def memory_floor(
    costs: ModelCosts, limits: MachineLimits, context_len: int, tokens_per_s: float
) -> dict[str, float]:
    """Batch-1 decode's best rate (weights + KV read once per token) and the fraction reached."""
    per_token = costs.bytes_per_token(context_len)
    floor = limits.memory_bandwidth / per_token
    return {
        "bytes_per_token": float(per_token),
        "memory_floor_tokens_per_s": floor,
        "fraction_of_memory_floor": tokens_per_s / floor if floor > 0 else 0.0,
    }
