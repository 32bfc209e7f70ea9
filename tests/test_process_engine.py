"""The engine in its own process: the same results as in-process, the same fault semantics."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tgengine import (
    Engine,
    EngineClient,
    EngineDeadError,
    EngineProcessExited,
    EngineSleepingError,
    EngineState,
    InvalidRequestError,
    ProcessEngine,
    SamplingParams,
    StructuredOutputsParams,
)
from tgengine.engine.request_stats import RequestStats, StepStats
from tgengine.models import iter_safetensors

from engine_helpers import (
    TIMEOUT,
    Consumer,
    collect,
    generate_all,
    greedy,
    make_prompts,
    stream_all,
    tiny_config,
    tokens_of,
)
from fault_injection import FaultInjector, InjectedExecutors
from model_factory import VOCAB_SIZE, make_tiny_model_dir
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
PROMPTS = make_prompts(VOCAB_SIZE, 4)
YES_NO = StructuredOutputsParams(choice=("yes", "no"))
BAD_REGEX = StructuredOutputsParams(regex="(unclosed")


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, torch.Tensor]]:
    other = make_tiny_model_dir(tmp_path_factory.mktemp("other"), arch="llama", seed=7)
    return list(iter_safetensors(other))


async def scenario(engine: EngineClient, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Everything a user observes through the public API, for one engine."""
    seen: dict[str, Any] = {}
    recorder = Recorder()
    engine.observers.append(recorder)
    batch = await generate_all(engine, PROMPTS, greedy(6))  # type: ignore[arg-type]
    seen["batch"] = [tokens_of(chunks) for chunks in batch]
    seen["text"] = "".join(c.text for c in await collect(engine, "Hello world", greedy(6)))  # type: ignore[arg-type]
    long = engine.generate(PROMPTS[0], greedy(100_000), request_id="long")
    first = await long.__anext__()
    engine.abort("long")
    rest = [first, *[c async for c in long]]
    seen["abort"] = (rest[-1].request_id, rest[-1].finish_reason)
    seen["ids in use"] = await ids_in_use(engine)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.generate([], greedy(1))
    two = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    chunks = await collect(engine, PROMPTS[3], two)  # type: ignore[arg-type]
    seen["n=2"] = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in (0, 1)}
    seen["n=2 ends"] = sorted((c.index, c.finish_reason) for c in chunks if c.finished)
    choice = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=YES_NO)
    seen["choice"] = "".join(c.text for c in await collect(engine, PROMPTS[2], choice))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        engine.generate(PROMPTS[0], SamplingParams(structured_outputs=BAD_REGEX))
    await engine.sleep(1)
    seen["asleep"] = (engine.state, engine.sleeping_tags, engine.is_sleeping)
    with pytest.raises(EngineSleepingError):
        engine.generate(PROMPTS[1], greedy(2))
    await engine.wakeup(["kv_cache"])
    seen["half_awake"] = engine.sleeping_tags
    await engine.wakeup()
    seen["woken"] = tokens_of(await collect(engine, PROMPTS[1], greedy(6)))  # type: ignore[arg-type]
    await engine.update_weights(named)
    updated = await collect(engine, PROMPTS[1], greedy(6))  # type: ignore[arg-type]
    seen["updated"] = (tokens_of(updated), updated[-1].weight_version, engine.weight_version)
    with pytest.raises(InvalidRequestError, match="weights"):
        await engine.update_weights([("model.nope.weight", named[0][1])])
    await engine.pause("keep")
    seen["paused"] = engine.state
    await engine.resume()
    stats = engine.stats()
    # generation_tokens_total differs by how far "long" got before its abort arrived
    seen["stats"] = (stats.prompt_tokens_total, stats.finished_total, stats.weight_version)
    seen["memory"] = {
        d: (m.weights_bytes, m.kv_cache_bytes) for d, m in engine.memory_stats().items()
    }
    seen["observed"] = (sorted(recorder.finished), recorder.steps > 0)
    return seen


async def ids_in_use(engine: EngineClient) -> list[tuple[str, int, str]]:
    """Which ids a request may take while others run: a live request's id, or a member
    id (``{id}#{i}``) of a live ``n > 1`` request, is refused at once (the call raises)."""
    two = SamplingParams(n=2, max_tokens=100_000, temperature=1.0, seed=3, ignore_eos=True)
    running = [
        engine.generate(PROMPTS[0], greedy(100_000), request_id="x#1"),
        engine.generate(PROMPTS[1], two, request_id="y"),
    ]
    for stream in running:
        await stream.__anext__()
    outcomes = []
    for request_id, n in (("x#1", 1), ("x", 2), ("x", 1), ("y", 1), ("y#1", 1), ("y#2", 1)):
        params = SamplingParams(n=n, max_tokens=1, temperature=1.0, seed=0)
        try:
            stream = engine.generate(PROMPTS[2], params, request_id=request_id)
        except InvalidRequestError as exc:
            outcomes.append((request_id, n, f"refused: {exc.field}"))
            continue
        chunks = [c async for c in stream]
        outcomes.append((request_id, n, str(chunks[-1].finish_reason)))
    for request_id in ("x#1", "y"):
        engine.abort(request_id)
    for stream in running:
        async for _ in stream:
            pass
    return outcomes


class Recorder:
    """An ``EngineObserver`` that keeps what it was told."""

    def __init__(self) -> None:
        self.finished: list[tuple[int, int, int]] = []
        self.steps = 0

    def request_finished(self, stats: RequestStats) -> None:
        self.finished.append((stats.num_prompt_tokens, stats.n, stats.max_tokens))

    def step_finished(self, stats: StepStats) -> None:
        self.steps += 1


@pytest.fixture(scope="module")
def in_process_results() -> dict[str, dict[str, Any]]:
    """The in-process engine's ``scenario``, run by the first backend and kept for the next:
    what it observes does not depend on the backend (the process client's run checks that)."""
    return {}


async def test_same_results_as_in_process(
    long_context_dir: Path,
    other_weights: list[tuple[str, torch.Tensor]],
    in_process_results: dict[str, dict[str, Any]],
) -> None:
    config = tiny_config(long_context_dir)
    before = child_pids()
    with anyio.fail_after(TIMEOUT):
        if "want" not in in_process_results:
            engine = Engine(config)
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                in_process_results["want"] = await scenario(engine, other_weights)
                engine.stop()
        want = in_process_results["want"]
        client = ProcessEngine(config)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            assert client.pid in child_pids()
            got = await scenario(client, other_weights)
            tg.cancel_scope.cancel()  # cancelling is stop(grace=0): the child goes too
    assert got == want
    assert want["updated"][0] != want["woken"]
    assert want["choice"] in ("yes", "no")
    assert want["n=2 ends"] == [(0, "length"), (1, "length")]
    assert want["ids in use"] == [
        ("x#1", 1, "refused: request_id"),
        ("x", 2, "refused: request_id"),  # its member x#1 is running
        ("x", 1, "length"),
        ("y", 1, "refused: request_id"),
        ("y#1", 1, "refused: request_id"),  # a member of y
        ("y#2", 1, "length"),  # y has members #0 and #1 only
    ]
    assert want["observed"][1] and len(want["observed"][0]) == 14
    assert client.state is EngineState.STOPPED
    assert child_pids() == before


async def test_faults_arrive_as_in_process(long_context_dir: Path) -> None:
    """A SIGKILL, an exception in the child and a failed start, each in its own engine
    process, side by side (the processes start at once: their start-up is most of the time)."""
    before = child_pids()
    with anyio.fail_after(2 * TIMEOUT):  # each scenario has TIMEOUT; all start at once
        async with anyio.create_task_group() as tg:
            tg.start_soon(sigkill_ends_every_stream_and_run_raises, long_context_dir)
            tg.start_soon(exception_in_the_child_arrives_as_the_cause, long_context_dir)
            tg.start_soon(a_failed_start_leaves_a_dead_engine, long_context_dir)
    assert child_pids() == before


async def a_failed_start_leaves_a_dead_engine(long_context_dir: Path) -> None:
    """The model does not load (a KV cache budget below one block): ``run()`` raises, and
    the engine refuses requests as dead, as ``Engine`` does (not as one not yet started)."""
    config = tiny_config(long_context_dir, num_blocks=None, kv_cache_memory=1)
    client = ProcessEngine(config)
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(EngineDeadError, match="KV cache budget of 1 bytes"):
            await client.run()
    assert client.state is EngineState.DEAD
    with pytest.raises(EngineDeadError, match="KV cache budget of 1 bytes"):
        client.generate(PROMPTS[0], greedy(2))


async def sigkill_ends_every_stream_and_run_raises(long_context_dir: Path) -> None:
    client = ProcessEngine(tiny_config(long_context_dir))
    consumers = [Consumer(client, p, greedy(100_000)) for p in PROMPTS]  # type: ignore[arg-type]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(client.run)
                await stream_all(tg, consumers)
                assert client.pid is not None
                os.kill(client.pid, signal.SIGKILL)
                with anyio.fail_after(2):
                    for consumer in consumers:
                        await consumer.done.wait()
    cause = info.value.exceptions[0].__cause__
    assert isinstance(cause, EngineProcessExited) and cause.returncode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value.exceptions[0])
    assert [c.finish_reason for c in consumers] == ["error"] * len(consumers)
    assert all(c.error is None for c in consumers), "admitted requests never raise"
    assert client.state is EngineState.DEAD
    with pytest.raises(EngineDeadError):
        client.generate(PROMPTS[0], greedy(2))
    assert client.pid not in child_pids()


async def exception_in_the_child_arrives_as_the_cause(long_context_dir: Path) -> None:
    faults = FaultInjector(
        raise_at={6: RuntimeError("injected in the child")},
        cache_not_ready_at={2: {"unlucky"}},
    )
    client = ProcessEngine(
        tiny_config(long_context_dir), executor_factory=InjectedExecutors(faults.plan())
    )
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(client.run)
                unlucky = Consumer(client, PROMPTS[0], greedy(100_000), request_id="unlucky")  # type: ignore[arg-type]
                lucky = Consumer(client, PROMPTS[1], greedy(100_000), request_id="lucky")  # type: ignore[arg-type]
                tg.start_soon(unlucky.run)
                tg.start_soon(lucky.run)
                await anyio.sleep_forever()
    cause = info.value.exceptions[0].__cause__
    assert type(cause) is RuntimeError and str(cause) == "injected in the child"
    assert unlucky.finish_reason == "error" and "KV cache" in (unlucky.chunks[-1].error or "")
    assert lucky.finish_reason == "error" and len(lucky.token_ids) >= 3, "ran on after step 2"
    assert "injected in the child" in (lucky.chunks[-1].error or "")
    assert client.pid not in child_pids()
