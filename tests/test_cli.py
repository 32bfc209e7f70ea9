"""The dev runner as a real subprocess: streaming, --help, one-line errors, signals."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tgengine.cli.common import add_engine_options, engine_config

TIMEOUT = 60
RUNNER = [sys.executable, "-m", "tgengine"]


def test_help_explains_each_option() -> None:
    out = subprocess.run(
        [*RUNNER, "generate", "--help"], capture_output=True, text=True, timeout=TIMEOUT, check=True
    ).stdout
    for option in ("--model", "--chat", "--max-tokens", "--temperature", "--seed", "--backend"):
        assert option in out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_generate_streams_text(tiny_llama_dir: Path, backend: str) -> None:
    result = subprocess.run(
        [
            *RUNNER,
            "generate",
            "Hello there",
            "--model",
            str(tiny_llama_dir),
            "--chat",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--backend",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "12 tokens" in result.stderr and "finish_reason=length" in result.stderr


@pytest.mark.parametrize("model", ["missing", "broken"])
def test_bad_model_dir_is_a_one_line_error(tmp_path: Path, model: str) -> None:
    path = tmp_path / model
    if model == "broken":
        path.mkdir()
        (path / "config.json").write_text("{not json")
    result = subprocess.run(
        [*RUNNER, "generate", "hi", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr


async def _run_and_signal(
    model_dir: Path, backend: str, signals: int, grace: str
) -> tuple[int, str]:
    command = [
        *RUNNER,
        "generate",
        "Once upon a time",
        "--model",
        str(model_dir),
        "--max-tokens",
        "100000000",
        "--ignore-eos",
        "--backend",
        backend,
        "--grace",
        grace,
    ]
    async with await anyio.open_process(command) as process:
        assert process.stdout is not None and process.stderr is not None
        await process.stdout.receive()  # generation is under way
        stderr = b""
        for _ in range(signals):
            process.send_signal(signal.SIGTERM)
            while b"stopping" not in stderr.rsplit(b"SIGTERM", 1)[-1]:
                stderr += await process.stderr.receive()  # handled: the next one is not merged
        async for data in process.stderr:
            stderr += data
        return await process.wait(), stderr.decode()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_sigterm_stops_gracefully_with_exit_0(long_context_dir: Path, backend: str) -> None:
    with anyio.fail_after(TIMEOUT):
        code, stderr = await _run_and_signal(long_context_dir, backend, signals=1, grace="0.5")
    assert code == 0, stderr
    assert "SIGTERM: stopping" in stderr and "finish_reason=abort" in stderr


@pytest.mark.anyio
async def test_second_signal_stops_at_once(long_context_dir: Path) -> None:
    # the grace is longer than the bound: only the second signal can end it in time
    with anyio.fail_after(TIMEOUT):
        code, stderr = await _run_and_signal(long_context_dir, "trio", signals=2, grace="3600")
    assert code == 0, stderr
    assert "again: stopping now" in stderr


def test_engine_options_reach_the_config(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    model = ["--model", str(tiny_llama_dir)]
    default = engine_config(parser.parse_args(model))
    assert default.prepack_weights is True and default.num_threads is None
    args = parser.parse_args(
        [*model, "--no-prepack-weights", "--dtype", "bfloat16", "--threads", "3"]
    )
    config = engine_config(args)
    assert config.prepack_weights is False and config.dtype == "bfloat16"
    assert config.num_threads == 3
