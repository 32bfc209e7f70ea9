"""What every bench needs: the resolved setup (model, dtype, device, threads) and the machine."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..kernels.isa import isa
from ..models import ModelConfig, load_model_config
from .roofline import MachineLimits, gemm_rate, measure_machine, measure_seconds, pick_threads

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchSetup:
    """One bench run's fixed choices; every system in the run uses the same ones."""

    model_dir: str
    dtype: str
    device: str
    threads: int | None
    progress: bool = True
    kv_cache_memory: int | None = None
    thread_rates: dict[str, float] = field(default_factory=dict)
    quick: bool = False  # shorter machine measurements (tests, smoke runs)
    tensor_parallel_size: int = 1
    executor: str | None = None  # EngineConfig.executor: None picks by the size
    ray_address: str | None = None
    quantization: str | None = None  # EngineConfig.quantization (tgengine's runs)
    prepack_weights: bool = True  # EngineConfig.prepack_weights (tgengine's runs)

    @staticmethod
    def resolve(
        model_dir: str,
        dtype: str,
        device: str,
        threads: str | int | None,
        *,
        progress: bool = True,
        kv_cache_memory: int | None = None,
        quick: bool = False,
        tensor_parallel_size: int = 1,
        executor: str | None = None,
        ray_address: str | None = None,
        quantization: str | None = None,
    ) -> BenchSetup:
        """Pick the device (``auto``: CUDA when present) and, on CPU, the thread count."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        rates: dict[str, float] = {}
        chosen: int | None = None
        if torch.device(device).type == "cpu":
            chosen, rates = pick_threads(threads, _DTYPES[dtype])
            torch.set_num_threads(chosen)
        return BenchSetup(
            model_dir,
            dtype,
            device,
            chosen,
            progress,
            kv_cache_memory,
            rates,
            quick,
            tensor_parallel_size,
            executor,
            ray_address,
            quantization,
        )

    @property
    def executor_kind(self) -> str:
        """As ``EngineConfig.executor_kind``: the executor, or the default for the size."""
        if self.executor is not None:
            return self.executor
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def model_config(self) -> ModelConfig:
        return load_model_config(self.model_dir)

    def measure_machine(self, threads: int | None = None) -> MachineLimits:
        """The machine's limits at this run's threads, or (on CPU) at ``threads``."""
        mc = self.model_config()
        with self._threads(threads):
            return measure_machine(
                self.device,
                self.torch_dtype,
                hidden=mc.hidden_size,
                intermediate=mc.intermediate_size,
                quick=self.quick,
            )

    def matmul_now(self, limits: MachineLimits, threads: int | None = None) -> float:
        """The GEMM rate now: ``limits.matmul_case`` timed again at ``threads`` (on CPU;
        default: this run's) for twice ``measure_machine``'s time (a shared machine's rate
        swings by a third from one half-second to the next)."""
        with self._threads(threads):
            return gemm_rate(self.device, limits.matmul_case, 2 * measure_seconds(self.quick))

    def around(
        self, limits: MachineLimits, threads: int | None, run: Callable[[], T]
    ) -> tuple[T, tuple[float, float]]:
        """``run()``'s result, and the GEMM rate (``matmul_now``) just before and just after it."""
        before = self.matmul_now(limits, threads)
        result = run()
        return result, (before, self.matmul_now(limits, threads))

    @contextmanager
    def _threads(self, threads: int | None) -> Iterator[None]:
        before = torch.get_num_threads()
        if threads is not None and torch.device(self.device).type == "cpu":
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_dir,
            "dtype": self.dtype,
            "device": self.device,
            "threads": self.threads,
            "thread_calibration_flops": self.thread_rates,
            "kv_cache_memory": self.kv_cache_memory,
            "tensor_parallel_size": self.tensor_parallel_size,
            "executor": self.executor_kind,
            "quantization": self.quantization,
            "prepack_weights": self.prepack_weights,
        }


def tgengine_runs(
    setup: BenchSetup, threads: tuple[int, ...] = ()
) -> Iterator[tuple[str, BenchSetup]]:
    """tgengine's runs in a bench: one at the bench's threads, named ``tgengine``, or (on CPU,
    with ``threads``) one per thread count, named ``tgengine t=N``. Torch's thread count is
    back at the bench's when the iteration ends."""
    if not threads or torch.device(setup.device).type != "cpu":
        yield "tgengine", setup
        return
    try:
        for n in threads:
            torch.set_num_threads(n)
            yield f"tgengine t={n}", dataclasses.replace(setup, threads=n)
    finally:
        torch.set_num_threads(setup.threads or torch.get_num_threads())


def is_tgengine(system: str) -> bool:
    return system == "tgengine" or system.startswith("tgengine t=")


def best_tgengine(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """tgengine's row with the highest ``key`` (of one per thread count), or None."""
    mine = [r for r in rows if is_tgengine(r["system"])]
    return max(mine, key=lambda r: r[key]) if mine else None


def machine_info(device: str) -> dict[str, Any]:
    """Where and when this ran: CPU, cores, GPU, library versions, date, command."""
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "isa": isa(),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(["python -m tgengine", *sys.argv[1:]]),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def rss_bytes() -> int:
    """This process's resident set size."""
    from ..agent.host_memory import process_rss

    return process_rss()[0]


def max_model_len(config: ModelConfig) -> int:
    return config.max_position_embeddings
