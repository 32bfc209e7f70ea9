"""Every option of ``generate`` and ``serve`` reaches the configuration it names, and only it.

Each table below must list every option its command has (a new option fails the test until
it is added here); each row changes one option from its default and expects exactly one
field of the built configuration to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from tgengine import EngineConfig, SamplingParams
from tgengine.cli import generate, serve
from tgengine.cli.main import build_parser
from tgengine.server import ServerConfig

MODEL = "/models/tiny"  # never opened: building a configuration does no I/O

# argv → (what it configures, field, value)
ENGINE_OPTIONS: dict[tuple[str, ...], tuple[str, str, Any]] = {
    ("--model", "/models/other"): ("engine", "model", "/models/other"),
    ("--dtype", "bfloat16"): ("engine", "dtype", "bfloat16"),
    ("--device", "cpu"): ("engine", "device", "cpu"),
    ("--kv-cache-memory", "1048576"): ("engine", "kv_cache_memory", 1048576),
    ("--max-model-len", "64"): ("engine", "max_model_len", 64),
    ("--no-prepack-weights",): ("engine", "prepack_weights", False),
    ("--prepack-weights",): ("engine", "prepack_weights", True),  # the default, said aloud
    ("--quantization", "int8"): ("engine", "quantization", "int8"),
    ("--threads", "3"): ("engine", "num_threads", 3),
    ("--tokenizer-mode", "hf"): ("engine", "tokenizer_mode", "hf"),
    ("--tensor-parallel-size", "2"): ("engine", "tensor_parallel_size", 2),
    ("--executor", "mp"): ("engine", "executor", "mp"),
    ("--ray-address", "auto"): ("engine", "ray_address", "auto"),
    ("--backend", "trio"): ("args", "backend", "trio"),
}
GENERATE_OPTIONS = {
    **ENGINE_OPTIONS,
    ("--chat",): ("args", "chat", True),
    ("--max-tokens", "7"): ("params", "max_tokens", 7),
    ("--temperature", "0.5"): ("params", "temperature", 0.5),
    ("--top-p", "0.5"): ("params", "top_p", 0.5),
    ("--top-k", "5"): ("params", "top_k", 5),
    ("--seed", "3"): ("params", "seed", 3),
    ("--ignore-eos",): ("params", "ignore_eos", True),
    ("--grace", "5"): ("args", "grace", 5.0),
}
SERVE_OPTIONS = {
    **ENGINE_OPTIONS,
    ("--host", "127.0.0.2"): ("server", "host", "127.0.0.2"),
    ("--port", "0"): ("server", "port", 0),
    ("--served-model-name", "tiny"): ("server", "served_model_name", "tiny"),
    ("--api-key", "k1"): ("server", "api_key", "k1"),
    ("--admin-key", "k2"): ("server", "admin_key", "k2"),
    ("--max-body-bytes", "1000"): ("server", "max_body_bytes", 1000),
    ("--max-weight-part-bytes", "1000"): ("server", "max_weight_part_bytes", 1000),
    ("--weight-update-timeout", "2.5"): ("server", "weight_update_timeout", 2.5),
    ("--health-stall-seconds", "2.5"): ("server", "health_stall_seconds", 2.5),
    ("--shutdown-grace", "3"): ("args", "shutdown_grace", 3.0),
    ("--max-num-seqs", "8"): ("engine", "max_num_seqs", 8),
    ("--when-asleep", "wait"): ("engine", "when_asleep", "wait"),
    ("--tool-call-parser", "hermes"): ("server", "tool_call_parser", "hermes"),
    ("--protect-metrics",): ("server", "protect_metrics", True),
    ("--metrics-prefix", "vllm"): ("server", "metrics_prefix", "vllm"),
    ("--allow-additional-properties",): ("server", "allow_additional_properties", True),
    ("--engine-process",): ("args", "engine_process", True),
    ("--no-engine-process",): ("args", "engine_process", False),  # the default
    ("--restart-on-failure",): ("args", "restart_on_failure", True),  # the default
    ("--no-restart-on-failure",): ("args", "restart_on_failure", False),
    ("--max-start-failures", "2"): ("args", "max_start_failures", 2),
}


@pytest.fixture(autouse=True)
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TGENGINE_API_KEY", raising=False)
    monkeypatch.delenv("TGENGINE_ADMIN_KEY", raising=False)


def built(command: str, *argv: str) -> dict[str, Any]:
    args = build_parser().parse_args([command, *(["hi"] if command == "generate" else []),
                                      "--model", MODEL, *argv])  # fmt: skip
    if command == "generate":
        engine, params = generate.configs(args)
        return {"engine": engine, "params": params, "args": args}
    engine, server = serve.configs(args)
    return {"engine": engine, "server": server, "args": args}


def option_strings(command: str) -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = commands.choices[command]
    return {s for a in sub._actions for s in a.option_strings} - {"-h", "--help"}


def test_generate_defaults() -> None:
    got = built("generate")
    assert got["engine"] == EngineConfig(model=MODEL)
    assert got["params"] == SamplingParams(max_tokens=128, temperature=0.0)
    assert (got["args"].backend, got["args"].chat, got["args"].grace) == ("asyncio", False, 2.0)


def test_serve_defaults() -> None:
    got = built("serve")
    assert got["engine"] == EngineConfig(model=MODEL)
    assert got["server"] == ServerConfig()
    assert (got["args"].backend, got["args"].shutdown_grace) == ("asyncio", 10.0)


@pytest.mark.parametrize(
    ("command", "table"), [("generate", GENERATE_OPTIONS), ("serve", SERVE_OPTIONS)]
)
def test_every_option_is_tested(command: str, table: dict[tuple[str, ...], Any]) -> None:
    assert option_strings(command) == {argv[0] for argv in table}


@pytest.mark.parametrize(
    ("command", "argv", "target"),
    [("generate", argv, t) for argv, t in GENERATE_OPTIONS.items()]
    + [("serve", argv, t) for argv, t in SERVE_OPTIONS.items()],
    ids=[f"generate{a[0]}" for a in GENERATE_OPTIONS] + [f"serve{a[0]}" for a in SERVE_OPTIONS],
)
def test_each_option_reaches_its_field(
    command: str, argv: tuple[str, ...], target: tuple[str, str, Any]
) -> None:
    default, got = built(command), built(command, *argv)
    where, field, value = target
    for name, config in got.items():
        if name == "args":
            continue
        want = default[name]
        if name == where:
            want = dataclasses.replace(want, **{field: value})
        assert config == want, (name, config, want)
    if where == "args":
        assert getattr(got["args"], field) == value
