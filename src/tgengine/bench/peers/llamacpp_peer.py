"""llama.cpp as a bench peer: its ``llama-server`` as a child, driven over ``/completion``.

The server listens on 127.0.0.1 on a free port with ``-t N -tb N``, one slot per request
(``-np``, each slot with the job's longest prompt + output as context) and continuous
batching. Requests go to its native ``/completion`` endpoint as token-id prompts with
``n_predict``, ``ignore_eos`` and ``cache_prompt: false``, greedy. The server is stopped (and
its process group killed) when the job ends, fails or is cancelled.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import IO, Any

import anyio
from anyio.abc import Process

from ...runtime.openmp_policy import user_environ
from .spec import DEFAULT_THREADS, PeerRunError, PeerSpec, log_tail

_STOP_GRACE_S = 10.0
_WARM_UP_LEN = 64  # a slot's context must hold the warm-up requests (24 + 4 tokens)
_POLL_S = 0.05


def server_command(peer: PeerSpec, job: dict[str, Any], port: int) -> list[str]:
    """The ``llama-server`` command line for ``job``."""
    slots = len(job["requests"]) if job["mode"] == "throughput" else 1
    per_slot = max(job["max_model_len"], _WARM_UP_LEN)
    command = [peer.executable, "-m", str(peer.gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(slots), "-c", str(slots * per_slot), "--cont-batching"]
    if job["threads"] != DEFAULT_THREADS:
        command += ["-t", str(job["threads"]), "-tb", str(job["threads"])]
    return command


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def _server(command: list[str], log: IO[bytes]) -> AsyncIterator[Process]:
    """``llama-server`` running for the block; terminated (then killed) when it exits."""
    process = await anyio.open_process(
        command, stdin=None, stdout=log, stderr=log, start_new_session=True, env=user_environ()
    )
    try:
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                _signal(process.terminate)
                with anyio.move_on_after(_STOP_GRACE_S):
                    await process.wait()
            if process.returncode is None:
                _signal(process.kill)
            await process.wait()


def _signal(send: Callable[[], None]) -> None:
    try:
        send()
    except ProcessLookupError:
        pass  # it exited in the meantime: nothing to stop


async def _wait_ready(client: Any, process: Process, log_path: Path) -> None:
    """Until ``/health`` answers 200 (it answers 503 while the model loads)."""
    import httpx

    while True:
        if process.returncode is not None:
            raise PeerRunError(
                f"llama-server exited with status {process.returncode}; log:\n{log_tail(log_path)}"
            )
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        await anyio.sleep(_POLL_S)


async def _complete(client: Any, request: dict[str, Any]) -> int:
    """One greedy completion; the number of tokens it generated."""
    body = {
        "prompt": request["prompt"],
        "n_predict": request["max_tokens"],
        "ignore_eos": True,
        "cache_prompt": False,
        "temperature": 0.0,
        "stream": False,
    }
    response = await client.post("/completion", json=body)
    if response.status_code != 200:
        raise PeerRunError(f"llama-server /completion: {response.status_code} {response.text}")
    return int(response.json()["tokens_predicted"])


async def _all_at_once(client: Any, requests: list[dict[str, Any]]) -> tuple[float, int]:
    counts = [0] * len(requests)

    async def one(i: int) -> None:
        counts[i] = await _complete(client, requests[i])

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return time.perf_counter() - start, sum(counts)


async def _single(client: Any, request: dict[str, Any]) -> dict[str, float]:
    """As vLLM's driver does: TTFT from a 1-token request, decode from the difference."""
    first, _ = await _all_at_once(client, [{**request, "max_tokens": 1}])
    whole, num_tokens = await _all_at_once(client, [request])
    decode_s = whole - first
    return {
        "ttft_s": first,
        "decode_tokens_per_s": (num_tokens - 1) / decode_s
        if num_tokens > 1 and decode_s > 0
        else 0.0,
        "output_tokens": float(num_tokens),
        "expected_tokens": float(request["max_tokens"]),
    }


async def _run(
    peer: PeerSpec, job: dict[str, Any], log: IO[bytes], log_path: Path
) -> dict[str, Any]:
    import httpx

    port = _free_port()
    start = time.perf_counter()
    async with _server(server_command(peer, job, port), log) as process:
        limits = httpx.Limits(max_connections=len(job.get("requests", ())) + 4)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=None, limits=limits
        ) as client:
            await _wait_ready(client, process, log_path)
            startup_s = time.perf_counter() - start
            props = (await client.get("/props")).json()
            warm = [{"prompt": list(range(16, 16 + n)), "max_tokens": 4} for n in (8, 24)]
            await _all_at_once(client, warm)
            result: dict[str, Any] = {
                "system": "llamacpp",
                "version": str(props.get("build_info", "unknown")),
                "startup_s": startup_s,
            }
            if job["mode"] == "throughput":
                wall, tokens = await _all_at_once(client, job["requests"])
                result.update({"wall_s": wall, "output_tokens": tokens})
            else:
                result["single"] = {
                    length: [await _single(client, r) for r in requests]
                    for length, requests in job["singles"].items()
                }
    return result


def run_llamacpp(
    peer: PeerSpec, job: dict[str, Any], *, timeout_s: float, log_dir: str | None = None
) -> dict[str, Any]:
    """Run ``job`` on llama.cpp at ``job["threads"]``; the same result dict as vLLM's driver.

    Blocks (its own event loop); raises ``PeerRunError`` when the server fails or the job
    runs past ``timeout_s``. The server never outlives the call.
    """
    import tempfile

    async def bounded(log: IO[bytes], log_path: Path) -> dict[str, Any]:
        with anyio.fail_after(timeout_s):
            return await _run(peer, job, log, log_path)

    with tempfile.TemporaryDirectory(prefix="tgengine-llamacpp-") as tmp:
        log_path = Path(log_dir or tmp) / f"llamacpp-{job['mode']}-t{job['threads']}.log"
        try:
            with open(log_path, "wb") as log:
                return anyio.run(partial(bounded, log, log_path))
        except TimeoutError:
            raise PeerRunError(
                f"llama.cpp ran past {timeout_s:.0f} s; log:\n{log_tail(log_path)}"
            ) from None
