"""Sleep, pause, weight updates, health, death and stop, as HTTP clients see them."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
import torch
from safetensors.torch import save_file

from server_helpers import (
    ADMIN_KEY,
    TIMEOUT,
    assert_error_body,
    completion_body,
    parse_sse,
    running_server,
    stream_lines,
    wait_until,
)
from tgengine import Engine

from fault_injection import FaultInjector

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"


def num_admitted(engine: Engine) -> int:
    stats = engine.stats()
    return stats.num_running + stats.num_waiting


async def greedy_texts(client: httpx.AsyncClient) -> list[str]:
    texts = []
    for prompt in ("Hello", "The quick brown fox", [7, 8, 9, 10]):
        response = await client.post(COMPLETIONS, json=completion_body(prompt, max_tokens=10))
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_mid_stream_aborts_streams_then_wakeup_restores(
    tiny_llama_dir: Path, level: int
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, admin_key=ADMIN_KEY) as running:
            async with running.client() as client, running.client(ADMIN_KEY) as admin:
                before = await greedy_texts(client)
                started = [anyio.Event() for _ in range(8)]
                results: list[tuple[int, list[str]]] = [(0, [])] * 8
                whole: list[httpx.Response] = []

                async def wait_whole() -> None:
                    body = completion_body(max_tokens=400, ignore_eos=True)
                    whole.append(await client.post(COMPLETIONS, json=body))

                async def consume(i: int) -> None:
                    body = completion_body(f"stream {i}", max_tokens=400, ignore_eos=True)
                    body["stream"] = True
                    results[i] = await stream_lines(client, COMPLETIONS, body, started[i].set)

                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(consume, i)
                    tg.start_soon(wait_whole)
                    for event in started:
                        await event.wait()
                    await wait_until(lambda: num_admitted(running.engine) == 9)
                    slept = await admin.post("/sleep", params={"level": level})
                assert slept.status_code == 200, slept.text
                assert slept.json()["state"] == "sleeping"

                refused = await client.post(COMPLETIONS, json=completion_body())
                error = assert_error_body(refused, 503)
                assert error["code"] == "engine_sleeping" and refused.headers["Retry-After"]
                assert (await admin.get("/is_sleeping")).json() == {"is_sleeping": True}
                health = await client.get("/health")
                assert health.status_code == 200 and health.json()["state"] == "sleeping"
                metrics = (await client.get("/metrics")).text
                state = "weights_offloaded" if level == 1 else "discard_all"
                assert f'sleep_state="{state}"}} 1.0' in metrics

                woke = await admin.post("/wakeup")
                assert woke.status_code == 200 and woke.json()["state"] == "running"
                after = await greedy_texts(client)

    assert whole[0].status_code == 200
    assert whole[0].json()["choices"][0]["finish_reason"] == "abort"
    for status, lines in results:
        events, done = parse_sse(lines)
        assert status == 200 and done
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert after == before


async def test_management_validates_and_keeps_state(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad_weights = tmp_path / "bad"
    bad_weights.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(bad_weights / "m.safetensors"))
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, admin_key=ADMIN_KEY) as running:
            async with running.client() as client, running.client(ADMIN_KEY) as admin:
                for path, params in [
                    ("/sleep", {"level": 3}),
                    ("/sleep", {"level": "one"}),
                    ("/sleep", {"mode": "bogus"}),  # keep is valid (issue 32)
                    ("/pause", {"mode": "bogus"}),
                    ("/wakeup", {"tags": "memory"}),
                ]:
                    error = assert_error_body(await admin.post(path, params=params), 400)
                    assert error["param"].split(".")[0] == next(iter(params))
                    assert running.engine.state.value == "running"
                bogus_kv = {"path": str(tiny_llama_dir), "kept_kv": "bogus"}
                for body in [
                    {"path": str(tmp_path / "missing")},
                    {"path": str(bad_weights)},
                    {},
                    bogus_kv,
                ]:
                    response = await admin.post("/update_weights", json=body)
                    assert_error_body(response, 400)
                assert running.engine.weight_version == 0

                updated = await admin.post("/update_weights", json={"path": str(tiny_llama_dir)})
                assert updated.status_code == 200 and updated.json()["weight_version"] == 1

                paused = await admin.post("/pause", params={"mode": "abort"})
                assert paused.status_code == 200 and paused.json()["state"] == "paused"
                error = assert_error_body(
                    await client.post(COMPLETIONS, json=completion_body()), 503
                )
                assert error["code"] == "engine_paused"
                assert (await admin.post("/resume")).json()["state"] == "running"
                assert (await client.post(COMPLETIONS, json=completion_body())).status_code == 200

                assert (await admin.post("/sleep")).status_code == 200
                error = assert_error_body(await admin.post("/resume"), 409)
                assert error["code"] == "illegal_state" and running.engine.is_sleeping
                partly = await admin.post("/wakeup", params={"tags": "weights"})
                assert partly.json()["sleeping_tags"] == ["kv_cache"]
                assert_error_body(await client.post(COMPLETIONS, json=completion_body()), 503)
                woke = await admin.post("/wakeup", params={"tags": ["kv_cache", "weights"]})
                assert woke.json()["state"] == "running"


async def test_health_reflects_a_wedged_step_loop(tiny_llama_dir: Path) -> None:
    faults = FaultInjector(hang_at={3})
    with anyio.fail_after(TIMEOUT):
        async with running_server(
            tiny_llama_dir, faults=faults, health_stall_seconds=0.2
        ) as running:
            async with running.client() as client:
                assert (await client.get("/health")).status_code == 200
                result: list[tuple[int, list[str]]] = []

                async def consume() -> None:
                    body = completion_body(max_tokens=10, stream=True)
                    result.append(await stream_lines(client, COMPLETIONS, body))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    stalled = await _poll_health(client, 503)
                    faults.release()
                    recovered = await _poll_health(client, 200)
    assert stalled["stalled"] and stalled["state"] == "running"
    assert not recovered["stalled"]
    events, done = parse_sse(result[0][1])
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"


async def _poll_health(client: httpx.AsyncClient, status: int) -> dict[str, object]:
    while True:  # bounded by the test's fail_after
        response = await client.get("/health")
        if response.status_code == status:
            return response.json()  # type: ignore[no-any-return]
        await anyio.sleep(0.02)


async def test_engine_death_ends_streams_with_error_then_503(tiny_llama_dir: Path) -> None:
    faults = FaultInjector(hang_at={2}, raise_at={2: RuntimeError("injected fault")})
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, faults=faults) as running:
            engine = running.engine
            async with running.client() as client:
                streamed: list[tuple[int, list[str]]] = []
                whole: list[httpx.Response] = []

                async def consume() -> None:
                    body = completion_body(max_tokens=50, stream=True)
                    streamed.append(await stream_lines(client, COMPLETIONS, body))

                async def wait_whole() -> None:
                    whole.append(await client.post(COMPLETIONS, json=completion_body()))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    tg.start_soon(wait_whole)
                    await wait_until(lambda: num_admitted(engine) == 2)
                    faults.release()  # step 2 now raises: the engine dies
                await running.engine_died.wait()
                refused = await client.post(COMPLETIONS, json=completion_body())
                health = await client.get("/health")
    status, lines = streamed[0]
    events, done = parse_sse(lines)
    assert status == 200 and done
    assert events[-1]["choices"][0]["finish_reason"] == "error"
    for response in (whole[0], refused):
        error = assert_error_body(response, 503)
        assert error["code"] == "engine_dead" and response.headers["Retry-After"]
    assert health.status_code == 503 and health.json()["state"] == "dead"


async def test_stop_refuses_new_requests_and_drains_running_ones(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir) as running:
            async with running.client() as client:
                first = anyio.Event()
                result: list[tuple[int, list[str]]] = []

                async def consume() -> None:
                    body = completion_body(max_tokens=40, ignore_eos=True, stream=True)
                    result.append(await stream_lines(client, COMPLETIONS, body, first.set))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    await first.wait()
                    running.engine.stop(grace=30)
                    refused = await client.post(COMPLETIONS, json=completion_body())
                    health = await client.get("/health")
    error = assert_error_body(refused, 503)
    assert error["code"] == "engine_stopped"
    assert health.status_code == 503 and health.json()["state"] in ("stopping", "stopped")
    events, done = parse_sse(result[0][1])
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"


async def test_metrics_mirror_vllm_names(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir) as running:
            async with running.client() as client:
                for stream in (False, True):
                    body = completion_body(max_tokens=5, ignore_eos=True, stream=stream)
                    assert (await client.post(COMPLETIONS, json=body)).status_code == 200
                response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in [
        "tgengine:num_requests_running",
        "tgengine:num_requests_waiting",
        "tgengine:kv_cache_usage_perc",
        "tgengine:engine_sleep_state",
        "tgengine:prompt_tokens_total",
        "tgengine:generation_tokens_total",
        "tgengine:time_to_first_token_seconds_bucket",
        "tgengine:inter_token_latency_seconds_bucket",
        "tgengine:e2e_request_latency_seconds_bucket",
    ]:
        assert f"\n{name}{{" in text, name
    assert 'tgengine:request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
    assert 'tgengine:generation_tokens_total{model_name="tiny"} 10.0' in text
    assert 'tgengine:time_to_first_token_seconds_count{model_name="tiny"} 2.0' in text
    assert 'tgengine:inter_token_latency_seconds_count{model_name="tiny"} 8.0' in text
    assert 'tgengine:engine_sleep_state{model_name="tiny",sleep_state="awake"} 1.0' in text
