"""``python -m tgengine serve`` as a real subprocess: URL, serving, SIGTERM drain, exit 0."""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import psutil
import pytest

from server_helpers import assert_error_body, completion_body, parse_sse, stream_lines
from tgengine.cli.main import build_parser

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
