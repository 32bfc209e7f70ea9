"""Helpers shared by the server tests: a real server on a free loopback port, SSE parsing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from tgengine import Engine, EngineClient, EngineDeadError, ProcessEngine
from tgengine.server import Server, ServerConfig

from engine_helpers import tiny_config
from fault_injection import FaultInjector, faulty_engine

MODEL = "tiny"
API_KEY = "test-api-key"
ADMIN_KEY = "test-admin-key"
TIMEOUT = 60  # seconds: a bound on any single server test; none should come close


@dataclass
class Running:
    engine: EngineClient
    server: Server
    url: str
    engine_died: anyio.Event
    engine_returned: anyio.Event  # set once the engine's run() has ended, however

    def client(self, key: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, **kwargs)


@asynccontextmanager
async def running_server(
    model_dir: Path,
    *,
    faults: FaultInjector | None = None,
    engine_options: dict[str, object] | None = None,
    own_process: bool = False,
    **server_options: Any,
) -> AsyncIterator[Running]:
    """An engine and its server, side by side in one task group; both stop on exit.

    An engine that dies does not take the server down here (so tests can watch the
    server answer for a dead engine): ``engine_died`` is set instead. ``own_process``: the
    engine in its own process (``ProcessEngine``; no ``faults`` then).
    """
    config = tiny_config(model_dir, **(engine_options or {}))
    engine: EngineClient
    if own_process:
        assert faults is None, "faults are injected into an in-process engine"
        engine = ProcessEngine(config)
    else:
        engine = Engine(config) if faults is None else faulty_engine(config, faults)
    server_options.setdefault("served_model_name", MODEL)
    server = Server(engine, ServerConfig(port=0, **server_options))
    died, returned = anyio.Event(), anyio.Event()

    async def run_engine(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await engine.run(task_status=task_status)
        except EngineDeadError:
            died.set()
        finally:
            returned.set()

    async with anyio.create_task_group() as tg:
        await tg.start(run_engine)
        await tg.start(server.run)
        try:
            yield Running(engine, server, server.url, died, returned)
        finally:
            if faults is not None:
                faults.release()
            tg.cancel_scope.cancel()


def completion_body(prompt: str | list[int] = "Hello", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    body.update(overrides)
    return body


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of a server-sent event stream, and whether it ended with [DONE]."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, "nothing may follow [DONE]"
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


async def stream_lines(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    on_event: Callable[[], None] | None = None,
) -> tuple[int, list[str]]:
    """POST a streaming request; every line of the answer (``on_event`` after each event)."""
    lines: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: ") and on_event is not None:
                on_event()
    return response.status_code, lines


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate``: a condition inside the server (e.g. that it has noticed a client
    hang up) that no public event announces. Bound it with the test's ``fail_after``."""
    while not predicate():  # noqa: ASYNC110 - nothing to wait on but the condition itself
        await anyio.sleep(0.005)


def assert_error_body(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """The response carries an OpenAI-shaped error body; returns ``body["error"]``."""
    if status is not None:
        assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error  # type: ignore[no-any-return]
