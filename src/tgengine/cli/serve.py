"""``python -m tgengine serve``: the OpenAI-compatible HTTP server on Hypercorn."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial

import anyio
import anyio.abc

from ..config import EngineConfig
from ..engine.client import EngineClient
from ..engine.engine import Engine
from ..errors import TGEngineError
from ..process import EngineSupervisor, ProcessEngine, RestartPolicy
from ..runtime.gc_heap import freeze_startup_heap
from ..server.config import TOOL_CALL_PARSERS, ServerConfig
from .common import add_engine_options, engine_config, fail
from .signals import stop_on_signals

DEFAULTS = ServerConfig()


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve the model over an OpenAI-compatible HTTP API (FastAPI on "
        "Hypercorn). Prints the URL once it can serve. SIGINT/SIGTERM: stop admitting "
        "(503), let running requests finish for --shutdown-grace seconds, abort the rest, "
        "exit 0; a second signal stops at once.",
    )
    add_engine_options(parser)
    parser.add_argument("--host", default=DEFAULTS.host, help="default: %(default)s")
    parser.add_argument(
        "--port", type=int, default=DEFAULTS.port, help="0 = a free port (default: %(default)s)"
    )
    parser.add_argument(
        "--served-model-name", help="the model's name in the API (default: the directory name)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TGENGINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and every route but /health, "
        "/metrics, /version, /tokenize and /detokenize (env: TGENGINE_API_KEY)",
    )
    parser.add_argument(
        "--protect-metrics",
        action="store_true",
        help="require the API key on /metrics too",
    )
    parser.add_argument(
        "--metrics-prefix",
        default=DEFAULTS.metrics_prefix,
        help="prefix of the Prometheus metric names; 'vllm' makes vLLM's Grafana dashboard "
        "work unchanged (default: %(default)s)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get("TGENGINE_ADMIN_KEY"),
        help="enable the management routes, guarded by this key (env: TGENGINE_ADMIN_KEY)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULTS.max_body_bytes,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-weight-part-bytes",
        type=int,
        default=DEFAULTS.max_weight_part_bytes,
        help="the largest part of a weight update sent over HTTP; parts stream to shared "
        "memory, beside --max-body-bytes (default: %(default)s)",
    )
    parser.add_argument(
        "--weight-update-timeout",
        type=float,
        default=DEFAULTS.weight_update_timeout,
        help="seconds an open weight update may go without a part before it is aborted "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--health-stall-seconds",
        type=float,
        default=DEFAULTS.health_stall_seconds,
        help="/health is 503 when work waits this long without a step (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds running requests get after a signal (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="largest batch (default: %(default)s)"
    )
    parser.add_argument(
        "--when-asleep",
        default="reject",
        choices=["reject", "wait"],
        help="requests while asleep: 503, or hold them until wakeup (default: %(default)s)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=DEFAULTS.tool_call_parser,
        choices=list(TOOL_CALL_PARSERS),
        help="the tool-call format of tool_choice=auto answers; auto: by the chat template "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--allow-additional-properties",
        action="store_true",
        help="JSON schemas (response_format, structured_outputs, tool parameters) allow "
        "properties they do not name, as JSON Schema reads them; by default an object schema "
        "without additionalProperties forbids them, as vLLM does",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the engine in its own process: HTTP, tokenizing and streaming no longer "
        "share an interpreter with the step loop, and a crash there spares the server "
        "(default: off)",
    )
    parser.add_argument(
        "--restart-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --engine-process: start a dead engine again, with exponential backoff; "
        "503 + Retry-After meanwhile (default: on)",
    )
    parser.add_argument(
        "--max-start-failures",
        type=int,
        default=RestartPolicy().max_start_failures,
        help="consecutive failed engine starts before giving up (exit 1) (default: %(default)s)",
    )
    parser.set_defaults(handler=run)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's configuration, from the parsed options."""
    config = engine_config(args, max_num_seqs=args.max_num_seqs, when_asleep=args.when_asleep)
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        max_body_bytes=args.max_body_bytes,
        max_weight_part_bytes=args.max_weight_part_bytes,
        weight_update_timeout=args.weight_update_timeout,
        health_stall_seconds=args.health_stall_seconds,
        tool_call_parser=args.tool_call_parser,
        protect_metrics=args.protect_metrics,
        metrics_prefix=args.metrics_prefix,
        allow_additional_properties=args.allow_additional_properties,
    )
    return config, server_config


def run(args: argparse.Namespace) -> int:
    try:
        config, server_config = configs(args)
        make_engine = partial(_engine, config, args)
        serve = partial(_serve, make_engine, server_config, args.shutdown_grace)
        anyio.run(serve, backend=args.backend)
    except (TGEngineError, ValueError, OSError) as exc:
        return fail(exc)
    return 0


def _engine(config: EngineConfig, args: argparse.Namespace) -> EngineClient:
    if not args.engine_process:
        return Engine(config)
    if not args.restart_on_failure:
        return ProcessEngine(config)
    return EngineSupervisor(config, RestartPolicy(max_start_failures=args.max_start_failures))


async def _serve(
    make_engine: Callable[[], EngineClient], server_config: ServerConfig, grace: float
) -> None:
    # FastAPI and the routes load here, not with the parser (``generate`` does not need them).
    from ..server import Server
    from ..server.context import served_name

    engine = make_engine()  # inside the event loop: it creates anyio primitives
    config = engine.config
    server = Server(engine, server_config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, engine, tg.cancel_scope, grace)

            async def run_engine(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                await engine.run(task_status=task_status)
                tg.cancel_scope.cancel()  # stopped and drained: the server goes too

            await tg.start(run_engine)
            await tg.start(server.run)
            freeze_startup_heap()  # this process is the server's: full collections skip start-up
            name = server_config.served_model_name or served_name(config.model)
            print(f"tgengine: serving {name!r} at {server.url}", flush=True)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
    print("tgengine: stopped", file=sys.stderr, flush=True)
