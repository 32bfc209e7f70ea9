"""Two ranks in two worker processes: the tokens of one, control calls on both, faults.

Every test counts this process's children before and after (no worker may survive).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest
import torch

from tgengine import Engine, EngineDeadError, EngineState, InvalidRequestError
from tgengine._faults import FaultInjector
from tgengine.executor import WorkerExited, WorkerFailed
from tgengine.models import iter_safetensors

from engine_helpers import (
    TIMEOUT,
    Consumer,
    collect,
    generate_all,
    greedy,
    hf_greedy_with_margin,
    make_prompts,
    stream_all,
    tiny_config,
    tokens_of,
)
from process_helpers import child_pids, worker_pids

pytestmark = pytest.mark.anyio
MAX_TOKENS = 8
MIN_MARGIN = 1e-3  # float32 sums in another order: only clear top-1 choices must match
ENDLESS = greedy(10_000)


class Boom(RuntimeError):
    pass


def tp2_config(model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return tiny_config(model_dir, tensor_parallel_size=2, **overrides)  # mp: the default


def clear_prompts(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts whose greedy continuation has a clear margin, and transformers' tokens."""
    prompts, wants = [], []
    for prompt in make_prompts(vocab_size=384):
        want, margin = hf_greedy_with_margin(model_dir, prompt, MAX_TOKENS)
        if margin >= MIN_MARGIN:
            prompts.append(prompt)
            wants.append(want)
    assert len(prompts) >= 4, "the tiny model should give clear margins for most prompts"
    return prompts, wants


async def test_two_ranks_give_the_tokens_of_one_and_obey_every_control_call(
    tiny_llama_dir: Path,
) -> None:
    before = child_pids()
    prompts, wants = clear_prompts(tiny_llama_dir)
    params = greedy(MAX_TOKENS)
    faults = FaultInjector(ranks={1})  # injected faults happen on rank 1 only
    engine = Engine(tp2_config(tiny_llama_dir), _faults=faults)
    weights = dict(iter_safetensors(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert len(worker_pids()) == 2
            results = await generate_all(engine, prompts, params)
            assert [tokens_of(r) for r in results] == wants

            memory = engine.memory_stats()
            assert sorted(memory) == ["rank0:cpu", "rank1:cpu"]
            assert all(m.weights_bytes > 0 and m.kv_cache_bytes > 0 for m in memory.values())
            for level in (1, 2, 1):
                await engine.sleep(level)
                asleep = engine.memory_stats()
                assert all(m.kv_cache_bytes == 0 for m in asleep.values()), level
                assert all(m.weights_bytes == 0 for m in asleep.values()), level
                await engine.wakeup()
                assert tokens_of(await collect(engine, prompts[0], params)) == wants[0]
            version = engine.weight_version  # sleep(2) reloaded from disk

            # A real change to a sharded tensor, and a bad tensor: neither is applied anywhere.
            q = "model.layers.0.self_attn.q_proj.weight"
            zeros = torch.zeros_like(weights[q])
            bad = ("model.layers.1.mlp.down_proj.weight", weights[q])
            with pytest.raises(InvalidRequestError, match="down_proj"):
                await engine.update_weights([(q, zeros), bad])
            assert engine.weight_version == version
            assert tokens_of(await collect(engine, prompts[1], params)) == wants[1]

            consumers = [Consumer(engine, p, greedy(30), f"r{i}") for i, p in enumerate(prompts)]
            await stream_all(tg, consumers)
            faults.cache_not_ready_at[faults.num_steps + 2] = {"r1"}  # on rank 1 only
            for c in consumers:
                await c.done.wait()
            assert engine.state is EngineState.RUNNING
            engine.stop()
    reasons = [c.finish_reason for c in consumers]
    assert reasons[1] == "error" and reasons.count("length") == len(prompts) - 1
    assert "cache not ready" in (consumers[1].chunks[-1].error or "").lower()
    assert child_pids() == before


async def test_killing_rank_1_errors_every_request_at_once(tiny_llama_dir: Path) -> None:
    before = child_pids()
    engine = Engine(tp2_config(tiny_llama_dir))
    prompts = make_prompts(vocab_size=384, count=4)
    consumers = [Consumer(engine, p, ENDLESS) for p in prompts]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                rank1 = engine._executor.pids[1]  # type: ignore[attr-defined]
                os.kill(rank1, signal.SIGKILL)
                killed = time.monotonic()
                for c in consumers:
                    await c.done.wait()
                ended = time.monotonic() - killed
                await anyio.sleep_forever()
    assert ended < 2.0
    assert [c.finish_reason for c in consumers] == ["error"] * len(prompts)
    cause = info.value.exceptions[0].__cause__
    assert isinstance(cause, WorkerExited) and cause.rank == 1
    assert "rank 1" in str(cause) and "SIGKILL" in str(cause)
    assert child_pids() == before, "rank 0, stuck in a collective, was killed too"


async def test_rank_1_raising_names_rank_and_error(tiny_llama_dir: Path) -> None:
    before = child_pids()
    faults = FaultInjector(ranks={1})
    engine = Engine(tp2_config(tiny_llama_dir), _faults=faults)
    consumers = [Consumer(engine, p, ENDLESS) for p in make_prompts(vocab_size=384, count=3)]
    with anyio.fail_after(TIMEOUT):
        with pytest.RaisesGroup(EngineDeadError) as info:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                await stream_all(tg, consumers)
                faults.raise_at[faults.num_steps + 2] = Boom("rank 1 only")
                await anyio.sleep_forever()
    cause = info.value.exceptions[0].__cause__
    assert isinstance(cause, WorkerFailed) and cause.rank == 1
    assert "Boom: rank 1 only" in str(cause)
    assert all(c.finish_reason == "error" for c in consumers)
    assert child_pids() == before
