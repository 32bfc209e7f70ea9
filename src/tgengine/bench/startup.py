"""``bench startup``: how long ``python -m tgengine generate`` takes to print its first token.

Each run is a fresh process (``sys.executable -m tgengine generate --max-tokens N PROMPT``),
timed from its start to the first byte on its stdout (the first token's text) and to its
exit. The caches a start reads (compiled kernels, the converted default model, parsed model
configs) are warmed by one run that is not counted, so the figures are warm starts: what a
user sees from the second run on.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from .common import BenchSetup

PROMPT = "Hello"


def cli_command(setup: BenchSetup, max_tokens: int, threads: int | None) -> list[str]:
    """The CLI's command line; ``threads`` None: the engine measures its own, as by default."""
    command = [sys.executable, "-m", "tgengine", "generate", "--model", setup.model_dir]
    command += ["--dtype", setup.dtype, "--device", setup.device, "--max-tokens", str(max_tokens)]
    if threads is not None:
        command += ["--threads", str(threads)]
    return [*command, PROMPT]


def time_one_start(command: list[str], timeout: float) -> dict[str, float]:
    """Seconds from spawning ``command`` to its first stdout byte and to its exit.

    A run still going after ``timeout`` seconds is killed (and reported as failed).
    """
    start = time.perf_counter()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy()
    ) as process:
        watchdog = threading.Timer(timeout, process.kill)
        watchdog.start()
        try:
            assert process.stdout is not None
            first = process.stdout.read(1)
            first_byte = time.perf_counter() - start
            _, stderr = process.communicate()
        finally:
            watchdog.cancel()
            if process.poll() is None:
                process.kill()
    exit_s = time.perf_counter() - start
    if process.returncode != 0 or not first:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}): {tail[0]}")
    return {"first_byte_s": first_byte, "exit_s": exit_s}


def run_startup(
    setup: BenchSetup,
    *,
    runs: int = 3,
    max_tokens: int = 8,
    threads: int | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    command = cli_command(setup, max_tokens, threads)
    time_one_start(command, timeout)  # warms the caches; not counted
    rows = [{"run": i + 1, **time_one_start(command, timeout)} for i in range(runs)]
    firsts = [r["first_byte_s"] for r in rows]
    return {
        "bench": "startup",
        "workload": {"runs": runs, "max_tokens": max_tokens, "prompt": PROMPT},
        "command": "python " + " ".join(command[1:]),
        "rows": rows,
        "summary": {
            "first_byte_min_s": min(firsts),
            "first_byte_median_s": statistics.median(firsts),
            "first_byte_max_s": max(firsts),
        },
    }
