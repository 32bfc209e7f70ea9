"""Weight updates in parts over HTTP (issue 32): begin, safetensors parts, commit or abort.

A second open update is a 409; a bad part a 400 naming the tensor (the update stays open);
an abandoned one (no part for the timeout, or a client gone halfway through a part) is
aborted and applies nothing. A non-streamed response whose request spanned an update says
which weights sampled which tokens (``weight_versions``); a streamed chunk carries its own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import torch

from server_helpers import ADMIN_KEY, MODEL, TIMEOUT, running_server
from tgengine import Engine, EngineClient, ProcessEngine
from tgengine.engine.request_stats import RequestStats, StepStats
from tgengine.ipc import weights_file
from tgengine.ipc.weights_file import write_weights_file
from tgengine.models import iter_safetensors
from tgengine.server import Server, ServerConfig
from tgengine.server.weight_uploads import Upload

from engine_helpers import hf_greedy, tiny_config
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8, 91, 120, 7]
UPDATES = "/weights/updates"


def body_of(named: list[tuple[str, torch.Tensor]], tmp_path: Path) -> bytes:
    """One part as a safetensors body."""
    file = tmp_path / f"part-{len(list(tmp_path.iterdir()))}.safetensors"
    write_weights_file(named, file)
    return file.read_bytes()


async def pieces(body: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    """``body`` as a chunked request's pieces (httpx sends no Content-Length then)."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def part_files() -> set[Path]:
    return set(weights_file.SHARED_MEMORY.glob("tgengine-weights-*"))


def parts_of(model_dir: Path, tmp_path: Path, size: int = 3) -> list[bytes]:
    named = list(iter_safetensors(model_dir))
    return [body_of(named[i : i + size], tmp_path) for i in range(0, len(named), size)]


async def complete(http: httpx.AsyncClient, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    response = await http.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return dict(response.json())


async def tokens(http: httpx.AsyncClient) -> str:
    return str((await complete(http))["choices"][0]["text"])


async def wait_for(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds, yielding to the other tasks between looks."""
    while not condition():
        await anyio.lowlevel.checkpoint()


async def ended(upload: Upload) -> None:
    while upload.state == "open":
        await upload.changed.wait()


async def test_an_update_in_parts(tiny_llama_dir: Path, other_dir: Path, tmp_path: Path) -> None:
    parts = parts_of(other_dir, tmp_path)
    name, tensor = next(iter(iter_safetensors(other_dir)))
    bad = body_of([(name, tensor[:1])], tmp_path)
    want = hf_greedy(other_dir, PROMPT, 8)
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, admin_key=ADMIN_KEY) as running:
            async with running.client(ADMIN_KEY) as http, running.client() as anonymous:
                before = await tokens(http)
                assert (await anonymous.post(UPDATES)).status_code == 401
                opened = await http.post(UPDATES)
                assert opened.status_code == 201, opened.text
                update_id = opened.json()["id"]
                second = await http.post(UPDATES)
                assert (second.status_code, second.json()["error"]["code"]) == (409, "update_open")
                for i, part in enumerate(parts):
                    # with a length, or chunked (no length: the server gathers the pieces)
                    body = part if i % 2 == 0 else pieces(part)
                    got = await http.post(f"{UPDATES}/{update_id}/parts", content=body)
                    assert got.status_code == 200, got.text
                    assert got.json()["num_parts"] == i + 1
                    if i == 0:  # a bad part: 400 naming it, the update stays open
                        refused = await http.post(f"{UPDATES}/{update_id}/parts", content=bad)
                        assert refused.status_code == 400
                        assert f"{name}: shape" in refused.json()["error"]["message"]
                        not_safetensors = b"not a safetensors file"
                        refused = await http.post(
                            f"{UPDATES}/{update_id}/parts", content=not_safetensors
                        )
                        assert refused.status_code == 400, refused.text
                    assert await tokens(http) == before  # nothing applies before the commit
                committed = await http.post(f"{UPDATES}/{update_id}/commit")
                assert committed.status_code == 200, committed.text
                assert committed.json()["state"] == "committed"
                assert committed.json()["weight_version"] == 1
                again = await http.post(f"{UPDATES}/{update_id}/commit")
                assert (again.status_code, again.json()["error"]["code"]) == (
                    409,
                    "update_committed",
                )
                assert (await http.post(f"{UPDATES}/nope/commit")).status_code == 404
                after = await complete(http)
                assert after["choices"][0]["weight_versions"] == [[0, 1]]
                assert after["choices"][0]["text"] == running.engine.tokenizer.decode(want)

                # aborted by the client: nothing applies, a later part is refused
                update_id = (await http.post(UPDATES)).json()["id"]
                assert (
                    await http.post(f"{UPDATES}/{update_id}/parts", content=parts[0])
                ).is_success
                dropped = await http.delete(f"{UPDATES}/{update_id}")
                assert dropped.json()["state"] == "aborted"
                late = await http.post(f"{UPDATES}/{update_id}/parts", content=parts[1])
                assert (late.status_code, late.json()["error"]["code"]) == (409, "update_aborted")
                assert running.engine.weight_version == 1


async def test_abandoned_updates_are_aborted(tiny_llama_dir: Path, tmp_path: Path) -> None:
    parts = parts_of(tiny_llama_dir, tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with running_server(
            tiny_llama_dir, admin_key=ADMIN_KEY, weight_update_timeout=0.5
        ) as running:
            uploads = running.server.weight_uploads
            assert uploads is not None
            async with running.client(ADMIN_KEY) as http:
                # no part for the timeout
                update_id = (await http.post(UPDATES)).json()["id"]
                await http.post(f"{UPDATES}/{update_id}/parts", content=parts[0])
                upload = uploads.get(update_id)
                await ended(upload)
                assert upload.state == "aborted" and "no part arrived" in str(upload.reason)
                late = await http.post(f"{UPDATES}/{update_id}/commit")
                assert late.status_code == 409 and "no part arrived" in late.text

                # the client leaves halfway through a part's body
                update_id = (await http.post(UPDATES)).json()["id"]
                upload = uploads.get(update_id)
                await send_half_a_part(running.url, update_id, parts[0])
                await ended(upload)
                assert upload.state == "aborted" and "disconnected" in str(upload.reason)
                opened = await http.post(UPDATES)
                assert opened.status_code == 201  # the slot is free
                assert (await http.delete(f"{UPDATES}/{opened.json()['id']}")).is_success

                # the same asleep: the abort drops what the engine absorbed of its parts
                # (held here until the next update was asked for), and an update begun
                # meanwhile waits for that, then opens
                await running.engine.sleep(2)
                executor = running.engine._executor  # type: ignore[attr-defined]
                drop, release = executor.drop_absorbed, anyio.Event()

                async def held_drop() -> None:
                    await release.wait()
                    await drop()

                executor.drop_absorbed = held_drop
                update_id = (await http.post(UPDATES)).json()["id"]
                sent = await http.post(f"{UPDATES}/{update_id}/parts", content=parts[0])
                assert sent.is_success
                upload = uploads.get(update_id)
                await send_half_a_part(running.url, update_id, parts[1])
                await ended(upload)
                assert uploads._closing is not None  # the engine's update is still ending
                async with anyio.create_task_group() as tg:

                    async def begin() -> None:
                        assert (await http.post(UPDATES)).status_code == 201

                    tg.start_soon(begin)
                    await wait_for(lambda: uploads._opening)  # it waits, it is not refused
                    release.set()
                executor.drop_absorbed = drop
            assert running.engine.weight_version == 0


async def send_half_a_part(url: str, update_id: str, part: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {UPDATES}/{update_id}/parts HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Length: {len(part)}\r\n\r\n"
    )
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(head.encode() + part[: len(part) // 2])


class Steps:
    """Sets ``running`` once a step ran with a request in it (it sampled a token)."""

    def __init__(self) -> None:
        self.running = anyio.Event()

    def step_finished(self, stats: StepStats) -> None:
        if stats.num_generation_tokens > 0:
            self.running.set()

    def request_finished(self, stats: RequestStats) -> None:
        pass


async def test_responses_say_which_weights_sampled_which_tokens(
    tiny_llama_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    parts = parts_of(other_dir, tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, admin_key=ADMIN_KEY) as running:
            steps = Steps()
            running.engine.observers.append(steps)
            async with running.client(ADMIN_KEY) as http:
                result: dict[str, Any] = {}

                async def spanning() -> None:
                    result.update(await complete(http, max_tokens=30))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(spanning)
                    await steps.running.wait()
                    paused = await http.post("/pause", params={"mode": "keep"})
                    assert paused.status_code == 200, paused.text
                    update_id = (await http.post(UPDATES)).json()["id"]
                    for part in parts:
                        await http.post(f"{UPDATES}/{update_id}/parts", content=part)
                    await http.post(f"{UPDATES}/{update_id}/commit")
                    await http.post("/resume")
                versions = result["choices"][0]["weight_versions"]
                assert versions[0] == [0, 0] and versions[1][1] == 1 and len(versions) == 2
                assert 0 < versions[1][0] < 30

                slept = await http.post("/sleep", params={"level": 1, "mode": "keep"})
                assert slept.status_code == 200, slept.text
                assert (await http.post("/wakeup")).status_code == 200

                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as stream:
                    events = [
                        json.loads(line[6:])
                        async for line in stream.aiter_lines()
                        if line.startswith("data: {")
                    ]
                assert events and all(e["choices"][0]["weight_version"] == 1 for e in events)


async def test_parts_over_http_reach_an_engine_process(
    tiny_llama_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    parts = parts_of(other_dir, tmp_path, size=5)
    before = child_pids()
    engine: EngineClient = ProcessEngine(tiny_config(tiny_llama_dir))
    server = Server(engine, ServerConfig(port=0, admin_key=ADMIN_KEY, served_model_name=MODEL))
    with anyio.fail_after(2 * TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await tg.start(server.run)
            headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
            files = part_files()
            async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
                update_id = (await http.post(UPDATES)).json()["id"]
                for part in parts:
                    got = await http.post(f"{UPDATES}/{update_id}/parts", content=part)
                    assert got.status_code == 200, got.text
                    assert len(part_files() - files) == 1, "one file serves every part"
                committed = await http.post(f"{UPDATES}/{update_id}/commit")
                assert committed.json()["weight_version"] == 1
                assert part_files() == files, "the part's file outlived its update"
                text = await tokens(http)
                update_id = (await http.post(UPDATES)).json()["id"]
                assert (
                    await http.post(f"{UPDATES}/{update_id}/parts", content=parts[0])
                ).is_success
                assert (await http.delete(f"{UPDATES}/{update_id}")).is_success
                assert part_files() == files, "an aborted update's file was left behind"
            tg.cancel_scope.cancel()
    assert text == engine.tokenizer.decode(hf_greedy(other_dir, PROMPT, 8))
    assert child_pids() == before


@pytest.mark.parametrize("where", ["server", "engine process"])
async def test_parts_by_their_path_in_shared_memory(
    tiny_llama_dir: Path, other_dir: Path, tmp_path: Path, where: str
) -> None:
    """A trainer on the same host writes each part to a file in /dev/shm itself and posts
    its path: the server's engine (or its engine process) reads it before the answer, and
    the file stays the trainer's (written over by the next part). A path outside /dev/shm,
    or leading out of it, is a 400 naming ``path``; an oversized file a 413."""
    named = list(iter_safetensors(other_dir))
    name, tensor = named[0]
    before_pids = child_pids()
    engine: EngineClient = (
        ProcessEngine(tiny_config(tiny_llama_dir))
        if where == "engine process"
        else Engine(tiny_config(tiny_llama_dir))
    )
    limit = max(t.nbytes for _, t in named) * 4
    config = ServerConfig(
        port=0, admin_key=ADMIN_KEY, served_model_name=MODEL, max_weight_part_bytes=limit
    )
    server = Server(engine, config)
    shared = weights_file.new_weights_dir()
    outside = tmp_path / "part.safetensors"
    write_weights_file(named[:1], outside)
    (shared / "link.safetensors").symlink_to(outside)
    write_weights_file(named, shared / "whole.safetensors")  # over the limit
    write_weights_file([(name, tensor[:1])], shared / "bad.safetensors")
    file = shared / "part.safetensors"
    try:
        with anyio.fail_after(2 * TIMEOUT):
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await tg.start(server.run)
                headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
                async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
                    before = await tokens(http)
                    update_id = (await http.post(UPDATES)).json()["id"]
                    route = f"{UPDATES}/{update_id}/parts/shared"
                    for path in [outside, shared / "link.safetensors", shared / "none", shared]:
                        refused = await http.post(route, json={"path": str(path)})
                        assert refused.status_code == 400, refused.text
                        assert refused.json()["error"]["param"] == "path"
                    refused = await http.post(
                        route, json={"path": str(shared / "whole.safetensors")}
                    )
                    assert refused.status_code == 413, refused.text
                    refused = await http.post(route, json={"path": str(shared / "bad.safetensors")})
                    assert refused.status_code == 400
                    assert f"{name}: shape" in refused.json()["error"]["message"]
                    for i in range(0, len(named), 3):
                        write_weights_file(named[i : i + 3], file)  # written over
                        got = await http.post(route, json={"path": str(file)})
                        assert got.status_code == 200, got.text
                        assert got.json()["num_parts"] == i // 3 + 1
                        assert file.exists(), "the trainer's file"
                        assert await tokens(http) == before  # nothing applies before the commit
                    committed = await http.post(f"{UPDATES}/{update_id}/commit")
                    assert committed.json()["weight_version"] == 1, committed.text
                    text = await tokens(http)
                tg.cancel_scope.cancel()
    finally:
        weights_file.remove_weights_dir(shared)
    assert text == engine.tokenizer.decode(hf_greedy(other_dir, PROMPT, 8))
    assert child_pids() == before_pids
