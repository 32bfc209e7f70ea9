"""A small load test: 200 requests from 50 concurrent clients; every one gets its final answer."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from server_helpers import MODEL, TIMEOUT, completion_body, parse_sse, running_server

pytestmark = pytest.mark.anyio

NUM_REQUESTS = 200
NUM_CLIENTS = 50


async def test_200_requests_from_50_clients_all_succeed(tiny_llama_dir: Path) -> None:
    finished: dict[int, str] = {}
    with anyio.fail_after(TIMEOUT * 2):
        async with running_server(tiny_llama_dir, engine_options={"num_blocks": 1024}) as running:
            queue_send, queue_receive = anyio.create_memory_object_stream[int](NUM_REQUESTS)
            for i in range(NUM_REQUESTS):
                queue_send.send_nowait(i)
            queue_send.close()

            async def client(http: httpx.AsyncClient) -> None:
                async for i in queue_receive:
                    finished[i] = await one_request(http, i)

            limits = httpx.Limits(max_connections=NUM_CLIENTS)
            async with running.client(limits=limits) as http:
                async with anyio.create_task_group() as tg:
                    for _ in range(NUM_CLIENTS):
                        tg.start_soon(client, http)
            stats = running.engine.stats()

    assert sorted(finished) == list(range(NUM_REQUESTS)), "no request lost"
    assert set(finished.values()) <= {"stop", "length"}
    assert sum(stats.finished_total.values()) == NUM_REQUESTS
    assert stats.num_running == stats.num_waiting == 0


async def one_request(http: httpx.AsyncClient, i: int) -> str:
    """Alternate completions and chat, streamed and whole; the finish reason."""
    stream = i % 2 == 0
    if i % 4 < 2:
        path, body = "/v1/completions", completion_body(f"request {i}", max_tokens=8)
    else:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}]}
        body["max_tokens"] = 8
    body["stream"] = stream
    if not stream:
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["finish_reason"])
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    events, done = parse_sse(lines)
    assert done
    return str(events[-1]["choices"][0]["finish_reason"])
