"""What every bench needs: the resolved setup (model, dtype, device, threads) and the machine."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models import ModelConfig, load_model_config
from .roofline import MachineLimits, measure_machine, pick_threads

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
        return BenchSetup(model_dir, dtype, device, chosen, progress, kv_cache_memory, rates, quick)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def model_config(self) -> ModelConfig:
        return load_model_config(self.model_dir)

    def measure_machine(self, threads: int | None = None) -> MachineLimits:
        """The machine's limits at this run's threads, or (on CPU) at ``threads``."""
        mc = self.model_config()
        before = torch.get_num_threads()
        if threads is not None and torch.device(self.device).type == "cpu":
            torch.set_num_threads(threads)
        try:
            return measure_machine(
                self.device,
                self.torch_dtype,
                hidden=mc.hidden_size,
                intermediate=mc.intermediate_size,
                quick=self.quick,
            )
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
        }


def machine_info(device: str) -> dict[str, Any]:
    """Where and when this ran: CPU, cores, GPU, library versions, date, command."""
    import transformers

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
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
    import psutil

    return int(psutil.Process().memory_info().rss)


def max_model_len(config: ModelConfig) -> int:
    return config.max_position_embeddings
