"""``python -m tgengine serve`` as a real subprocess: URL, serving, SIGTERM drain, exit 0."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import psutil
import pytest

from server_helpers import assert_error_body, completion_body, parse_sse, stream_lines
from tgengine.cli import default_model
from tgengine.cli.main import build_parser
from tgengine.runtime.disk_cache import cache_root

from process_helpers import child_pids, still_running

TIMEOUT = 90
RUNNER = [sys.executable, "-m", "tgengine"]


def test_serve_help_lists_the_options() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = commands.choices["serve"].format_help()
    for option in ("--model", "--host", "--port", "--backend", "--api-key", "--admin-key",
                   "--shutdown-grace", "--served-model-name", "--max-body-bytes"):  # fmt: skip
        assert option in text


@pytest.mark.anyio
@pytest.mark.parametrize(
    "where", ["in-process", "engine-process", "mp-executor"], ids=lambda where: where
)
async def test_sigterm_drains_then_aborts_then_exits_0(
    long_context_dir: Path, anyio_backend: str, where: str
) -> None:
    command = [*RUNNER, "serve", "--model", str(long_context_dir), "--port", "0",
               "--backend", anyio_backend, "--served-model-name", "tiny", "--dtype", "float32",
               "--shutdown-grace", "4"]  # fmt: skip
    if where == "engine-process":
        command.append("--engine-process")
    elif where == "mp-executor":
        command += ["--executor", "mp"]  # its worker must be gone too
    before = child_pids()
    with anyio.fail_after(TIMEOUT):
        async with await anyio.open_process(command) as process:
            assert process.stdout is not None and process.stderr is not None
            out = b""
            while not re.search(rb"http://\S+\n", out):
                out += await process.stdout.receive()
            url = re.search(rb"(http://\S+)\n", out)
            assert url is not None
            below = psutil.Process(process.pid).children(recursive=True)
            async with httpx.AsyncClient(base_url=url.group(1).decode(), timeout=30) as http:
                ready = (await http.get("/health")).json()
                card = (await http.get("/v1/models")).json()["data"][0]
                endless = card["max_model_len"] - 64  # fits the context; outlives the grace
                started = [anyio.Event(), anyio.Event()]
                results: list[tuple[int, list[str]]] = [(0, []), (0, [])]

                async def consume(i: int, max_tokens: int) -> None:
                    body = completion_body(max_tokens=max_tokens, ignore_eos=True, stream=True)
                    lines = await stream_lines(http, "/v1/completions", body, started[i].set)
                    results[i] = lines

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume, 0, 6)  # finishes within the grace
                    tg.start_soon(consume, 1, endless)  # cannot: aborted when the grace ends
                    for event in started:
                        await event.wait()
                    process.send_signal(signal.SIGTERM)
                    stderr = b""
                    while b"stopping" not in stderr:
                        stderr += await process.stderr.receive()
                    refused = await http.post("/v1/completions", json=completion_body())
                    health = await http.get("/health")
            async for data in process.stderr:
                stderr += data
            code = await process.wait()

    assert ready["status"] == "ok"
    assert code == 0, stderr.decode()
    error = assert_error_body(refused, 503)
    assert error["code"] == "engine_stopped" and refused.headers["Retry-After"]
    assert health.status_code == 503
    reasons = []
    for status, lines in results:
        events, done = parse_sse(lines)
        assert status == 200 and done
        reasons.append(events[-1]["choices"][0]["finish_reason"])
    assert reasons == ["length", "abort"]
    assert child_pids() == before, "serve and its engine process have both exited"
    assert still_running(below) == [], "no worker outlived serve"
    assert len(below) == (0 if where == "in-process" else 1)


def test_a_crash_loop_gives_up_and_exits_1(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    before = child_pids()
    command = [*RUNNER, "serve", "--model", str(broken), "--port", "0", "--dtype", "float32",
               "--engine-process", "--max-start-failures", "1"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 1, result.stderr
    assert "gave up after 2 failed starts" in result.stderr
    assert "cannot load model" in result.stderr, "the cause is named"
    assert result.stdout == "", "it never served"
    assert child_pids() == before


DEFAULT_URL = "http://127.0.0.1:8000"  # docs/server.md: --host 127.0.0.1, --port 8000


def default_model_cache(model_dir: Path, root: Path) -> dict[str, str]:
    """An environment whose default model (``serve`` without ``--model``) is ``model_dir``:
    a finished conversion under ``$TGENGINE_CACHE``, so nothing is downloaded. The rest of
    the cache (compiled kernels, tokenizer and config facts) is this process's, linked,
    so that nothing is built again. No key comes from the environment either."""
    target = root / default_model.DEFAULT_MODEL_NAME
    shutil.copytree(model_dir, target)
    (target / default_model._MARKER).write_text("{}")
    shared = cache_root()
    (shared / "kernels").mkdir(parents=True, exist_ok=True)  # built there at most once
    for entry in shared.iterdir():
        if not entry.name.startswith(default_model.DEFAULT_MODEL_NAME):
            (root / entry.name).symlink_to(entry)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TGENGINE_")}
    return env | {"TGENGINE_CACHE": str(root)}


@asynccontextmanager
async def serve_without_flags(env: dict[str, str]) -> AsyncIterator[tuple[anyio.abc.Process, str]]:
    """``python -m tgengine serve`` with no flags at all, and the URL it prints; killed on
    the way out if the test did not see it exit."""
    async with await anyio.open_process([*RUNNER, "serve"], env=env) as process:
        try:
            assert process.stdout is not None
            out = b""
            while not re.search(rb"http://\S+\n", out):
                out += await process.stdout.receive()
            url = re.search(rb"serving '([^']+)' at (http://\S+)\n", out)
            assert url is not None, out
            assert url.group(1).decode() == default_model.DEFAULT_MODEL_NAME, out
            yield process, url.group(2).decode()
        finally:
            if process.returncode is None:
                process.kill()


def http_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=30)


def port_8000_is_free() -> bool:
    """Whether nothing listens there (a closed connection's TIME_WAIT does not count: the
    server binds with SO_REUSEADDR too)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", 8000))
        except OSError:
            return False
    return True


# one run: the server's backend is serve's default (asyncio) whatever the test client's
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_without_flags_does_what_the_docs_say(
    long_context_dir: Path, tmp_path: Path
) -> None:
    """Each documented default of ``serve``, against what the running server does.

    Two starts, neither with a flag: the first with nothing in the environment (no keys),
    the second with ``TGENGINE_ADMIN_KEY`` (the documented alternative to ``--admin-key``),
    to sleep it and see ``--when-asleep``'s default, then SIGTERM for ``--shutdown-grace``'s.
    Not observable from outside in a test's time: ``--health-stall-seconds`` (30 s of a
    wedged step), ``--max-num-seqs`` (256 concurrent requests); ``ServerConfig``'s and
    ``EngineConfig``'s tests pin those values.
    """
    if not port_8000_is_free():
        pytest.skip("127.0.0.1:8000 (serve's default port) is taken on this machine")
    env = default_model_cache(long_context_dir, tmp_path / "cache")
    name = default_model.DEFAULT_MODEL_NAME
    with anyio.fail_after(3 * TIMEOUT):
        async with serve_without_flags(env) as (process, url), http_client(url) as http:
            below = psutil.Process(process.pid).children(recursive=True)
            models = await http.get("/v1/models")  # no --api-key: the API is open
            completed = await http.post(
                "/v1/completions", json=completion_body(model=name, max_tokens=2)
            )
            management = await http.post("/sleep")  # no --admin-key: no management routes
            metrics = await http.get("/metrics")  # open (no --protect-metrics)
            too_big = await http.post(
                "/v1/completions",
                content=b" " * (4 * 1024 * 1024 + 1),  # --max-body-bytes: 4 MiB
                headers={"content-type": "application/json"},
            )
            at_limit = await http.post(
                "/v1/completions",
                content=b" " * (4 * 1024 * 1024),
                headers={"content-type": "application/json"},
            )
            process.send_signal(signal.SIGTERM)
            first_code = await process.wait()

        admin = {"TGENGINE_ADMIN_KEY": "sk-admin"}
        headers = {"Authorization": "Bearer sk-admin"}
        async with serve_without_flags(env | admin) as (process, _), http_client(url) as http:
            asleep = await http.post("/sleep", headers=headers)
            try:  # reject answers at once; wait would hold it until a wakeup
                refused = await http.post(
                    "/v1/completions", json=completion_body(model=name), timeout=10
                )
            except httpx.ReadTimeout:
                pytest.fail("a request while asleep was held, not refused: when_asleep='wait'")
            await http.post("/wakeup", headers=headers)
            endless = (await http.get("/v1/models")).json()["data"][0]["max_model_len"] - 64
            started = anyio.Event()
            result: list[tuple[int, list[str]]] = []
            timing: dict[str, float] = {}

            async def consume() -> None:
                body = completion_body(model=name, max_tokens=endless, ignore_eos=True, stream=True)
                result.append(await stream_lines(http, "/v1/completions", body, started.set))
                timing["ended"] = time.monotonic()

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await started.wait()
                timing["signalled"] = time.monotonic()
                process.send_signal(signal.SIGTERM)
            second_code = await process.wait()

    assert url == DEFAULT_URL
    assert [m["id"] for m in models.json()["data"]] == [name]  # the directory's basename
    assert completed.status_code == 200, completed.text
    assert management.status_code == 404
    assert metrics.status_code == 200 and "tgengine:num_requests_running" in metrics.text
    assert 'enable_prefix_caching="True"' in metrics.text
    assert assert_error_body(too_big, 413)["code"] == "request_too_large"
    assert at_limit.status_code == 400  # read whole (not JSON), so within the limit
    assert below == [], "no --engine-process: the engine runs in serve's own process"
    assert first_code == 0
    assert asleep.status_code == 200 and asleep.json()["state"] == "sleeping"
    error = assert_error_body(refused, 503)  # --when-asleep reject: refused, not held
    assert error["code"] == "engine_sleeping" and refused.headers["Retry-After"]
    status, lines = result[0]
    events, done = parse_sse(lines)
    assert status == 200 and done and events[-1]["choices"][0]["finish_reason"] == "abort"
    waited = timing["ended"] - timing["signalled"]
    assert 9.5 <= waited < 10 + TIMEOUT / 3, waited  # --shutdown-grace: 10 s
    assert second_code == 0
