"""vLLM as a bench peer: ``vllm_driver.py`` run by the python of vLLM's own environment.

The driver is a child process in a new session; whatever it leaves behind (vLLM starts an
engine-core process of its own) is killed with its process group when it ends or times out.
Its output goes to a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ...runtime.openmp_policy import user_environ
from .spec import PeerRunError, PeerSpec, Threads, log_tail

DRIVER = Path(__file__).with_name("vllm_driver.py")


def cpu_binding(threads: Threads) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads``: ``auto`` (vLLM's default) or the
    first ``threads`` CPUs this process may use, as ``0-1`` or ``0,2``."""
    if isinstance(threads, str):  # DEFAULT_THREADS
        return "auto"
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return str(cpus[0]) if len(cpus) == 1 else f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def peer_env(threads: Threads, *, job_sets_kv_cache: bool = False) -> dict[str, str]:
    """The peer's environment: this one without PYTHONPATH (its own packages only), vLLM on
    loopback, a KV cache of 4 GiB unless one is set, and the thread binding.

    ``job_sets_kv_cache``: the job gives vLLM its KV cache size itself (the ``memory`` job),
    so ``VLLM_CPU_KVCACHE_SPACE``, which vLLM would let win, is unset."""
    env = {k: v for k, v in user_environ().items() if k != "PYTHONPATH"}
    env["VLLM_HOST_IP"] = "127.0.0.1"
    if job_sets_kv_cache:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(threads)
    return env


def run_vllm(
    peer: PeerSpec, job: dict[str, Any], *, timeout_s: float, log_dir: str | None = None
) -> dict[str, Any]:
    """Run ``job`` on vLLM at ``job["threads"]``; the driver's result dict.

    Blocks until the driver exits (the first start of vLLM compiles for minutes); raises
    ``PeerRunError`` when it fails or runs past ``timeout_s``.
    """
    with tempfile.TemporaryDirectory(prefix="tgengine-vllm-") as tmp:
        result_path = Path(tmp) / "result.json"
        log_path = Path(log_dir or tmp) / f"vllm-{job['mode']}-t{job['threads']}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [peer.executable, str(DRIVER), str(result_path)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=peer_env(job["threads"], job_sets_kv_cache="kv_cache_bytes" in job),
                start_new_session=True,
            )
            try:
                process.communicate(json.dumps(job).encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                raise PeerRunError(
                    f"vllm ran past {timeout_s:.0f} s; log:\n{log_tail(log_path)}"
                ) from None
            finally:
                _kill_group(process)
        if process.returncode != 0 or not result_path.is_file():
            raise PeerRunError(
                f"vllm exited with status {process.returncode}; log:\n{log_tail(log_path)}"
            )
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill what is left of the driver's process group, and reap the driver."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone: nothing left to kill
    process.wait()
