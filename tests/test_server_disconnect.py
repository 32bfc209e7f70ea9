"""Clients that leave mid-request: their requests are aborted and their KV blocks freed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest

from server_helpers import TIMEOUT, completion_body, running_server, wait_until

pytestmark = pytest.mark.anyio

NUM_CLIENTS = 32


def raw_request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def drop_after(host: str, port: int, request: bytes, num_bytes: int) -> int:
    """Send ``request``, read ``num_bytes`` of the answer (0: none), then hang up."""
    received = 0
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(request)
        while received < num_bytes:
            try:
                received += len(await stream.receive())
            except anyio.EndOfStream:
                break
    return received


async def test_dropped_clients_free_every_block(tiny_llama_dir: Path) -> None:
    rng = random.Random(4)
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir) as running:
            engine = running.engine
            assert running.server.address is not None
            host, port = running.server.address
            received: list[int] = []

            async def client(i: int) -> None:
                stream = i % 4 != 0  # every fourth client waits for a whole (non-streamed) body
                body = completion_body(f"client {i}", max_tokens=400, ignore_eos=True)
                body["stream"] = stream
                num_bytes = rng.choice([0, 1, 200, 600, 1500, 3000]) if stream else 0
                received.append(await drop_after(host, port, raw_request(body), num_bytes))

            async with anyio.create_task_group() as tg:
                for i in range(NUM_CLIENTS):
                    tg.start_soon(client, i)

            def idle() -> bool:
                stats = engine.stats()
                return stats.num_running == 0 and stats.num_waiting == 0

            await wait_until(idle)
            stats = engine.stats()
            async with running.client() as http:
                after = await http.post("/v1/completions", json=completion_body())
                metrics = (await http.get("/metrics")).text

    assert len(received) == NUM_CLIENTS and max(received) > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.kv_cache_usage == 0.0
    assert stats.finished_total.get("length", 0) == 0, "every dropped request was aborted"
    assert stats.finished_total.get("abort", 0) >= NUM_CLIENTS // 2
    assert after.status_code == 200
    assert 'tgengine:num_requests_running{model_name="tiny"} 0.0' in metrics
