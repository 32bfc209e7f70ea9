"""The server with the engine in its own process: a killed engine is started again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import httpx
import pytest

from server_helpers import MODEL, assert_error_body, completion_body, parse_sse, stream_lines
from tgengine.process import EngineSupervisor, RestartPolicy
from tgengine.server import Server, ServerConfig

from engine_helpers import tiny_config
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
TIMEOUT = 120  # two engine processes start in this test
COMPLETIONS = "/v1/completions"


async def health_becomes(http: httpx.AsyncClient, status: int) -> httpx.Response:
    """Poll ``/health`` until it answers ``status``: the engine process's start and death are
    in another process, and no event here announces them. Bound it with ``fail_after``."""
    while (response := await http.get("/health")).status_code != status:  # noqa: ASYNC110
        await anyio.sleep(0.05)
    return response


async def test_a_killed_engine_is_restarted_and_serves_again(long_context_dir: Path) -> None:
    before = child_pids()
    policy = RestartPolicy(initial_backoff=0.1)
    supervisor = EngineSupervisor(tiny_config(long_context_dir), policy)
    server = Server(supervisor, ServerConfig(port=0, served_model_name=MODEL))
    streamed: list[tuple[int, list[str]]] = []
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            await tg.start(server.run)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                first = (await http.post(COMPLETIONS, json=completion_body())).json()
                streaming = anyio.Event()
                body = completion_body(max_tokens=500, ignore_eos=True, stream=True)

                async def consume() -> None:
                    streamed.append(await stream_lines(http, COMPLETIONS, body, streaming.set))

                async with anyio.create_task_group() as clients:
                    clients.start_soon(consume)
                    await streaming.wait()
                    killed = supervisor.pid
                    assert killed is not None and killed in child_pids()
                    os.kill(killed, signal.SIGKILL)
                down = await health_becomes(http, 503)
                refused = await http.post(COMPLETIONS, json=completion_body())
                await health_becomes(http, 200)
                again = (await http.post(COMPLETIONS, json=completion_body())).json()
                metrics = (await http.get("/metrics")).text
            supervisor.stop()
            tg.cancel_scope.cancel()  # the server runs until cancelled
    status, lines = streamed[0]
    events, done = parse_sse(lines)
    assert status == 200 and done and events[-1]["choices"][0]["finish_reason"] == "error"
    assert down.json()["state"] == "dead"
    error = assert_error_body(refused, 503)
    assert error["code"] == "engine_dead" and refused.headers["Retry-After"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert f'tgengine:engine_restarts_total{{model_name="{MODEL}"}} 1.0' in metrics
    assert supervisor.num_restarts == 1 and supervisor.pid is None
    assert child_pids() == before
