"""The RL loop of ``tgengine.examples.rl`` on a tiny model: cycles, agreement, a restart.

Three GRPO cycles in-process (rewards, changed weights that the engine follows, weight
versions equal to the trainer's step); the trainer's and the engine's log probabilities of
the same sampled tokens agree within ``LOGPROB_TOL`` (float32 on both sides: measured
within 3.8e-6 on this model, 5.2e-6 on bench rl's over 1,000 cycles and 4.9e-5
on SmolLM2-135M over 30 steps); and the engine in its own process
killed mid-rollout: without a supervisor the loop raises ``EngineDeadError`` at once, with
one it resumes on the restarted engine with the weights it pushed last.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tgengine import Engine, EngineDeadError, ProcessEngine, SamplingParams
from tgengine.bench.rl import KillDuringRollout
from tgengine.examples.rl import (
    RLLoop,
    Sample,
    Trainer,
    group_advantages,
    make_prompts,
    number_reward,
)
from tgengine.kernels.isa import isa
from tgengine.process.supervisor import EngineSupervisor, RestartPolicy

from engine_helpers import TIMEOUT, tiny_config
from model_factory import VOCAB_SIZE
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
LOGPROB_TOL = 1e-4  # nats; float32 engine and trainer on the same weights
PROMPTS = [[3 + (5 * i + 7 * j) % (VOCAB_SIZE - 3) for j in range(6 + 3 * i)] for i in range(3)]
PARAMS = SamplingParams(n=4, max_tokens=6, temperature=1.0, logprobs=0, seed=0)


def even_reward(step: int, i: int, sample: Sample) -> float:
    return sum(t % 2 == 0 for t in sample.token_ids) / max(1, len(sample.token_ids))


def make_loop(engine: Any, model_dir: Path) -> RLLoop:
    trainer = Trainer(str(model_dir), lr=1e-2)
    return RLLoop(engine, trainer, lambda step: PROMPTS, even_reward, PARAMS, cycle_timeout=30)


def test_group_advantages_and_reward() -> None:
    assert group_advantages([1.0, 1.0]) == [0.0, 0.0]
    adv = group_advantages([0.0, 1.0, 0.5, 0.5])
    assert abs(sum(adv)) < 1e-9 and adv[1] > adv[2] == adv[3] > adv[0]
    prompt = make_prompts(1)[0]
    mid = (prompt.lo + prompt.hi) // 2
    assert number_reward(prompt, f" {mid}. ") == 1.0
    assert number_reward(prompt, f"It is {mid}, I think") == 0.5
    assert number_reward(prompt, str(prompt.hi + 1)) == 0.2
    assert number_reward(prompt, "no idea") == 0.0


async def test_three_cycles_in_process(tiny_llama_dir: Path) -> None:
    engine = Engine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            loop = make_loop(engine, tiny_llama_dir)
            before = {n: t.clone() for n, t in loop.trainer.trained_weights()}
            first = await loop.rollout(PROMPTS)
            rows = [stats async for stats in loop.cycles(3)]
            engine.stop()
    assert [r.step for r in rows] == [1, 2, 3]
    for r in rows:
        assert len(r.rewards) == len(PROMPTS) * PARAMS.n
        assert all(0.0 <= x <= 1.0 for x in r.rewards) and r.num_tokens > 0
        assert r.weight_versions == [r.step - 1] == [r.expected_version]  # version = step
        assert r.train.logprob_abs_diff_max < LOGPROB_TOL, r.train
        assert set(r.seconds) == {
            "generate",
            "sleep",
            "train",
            "wakeup weights",
            "push",
            "wakeup kv_cache",
        }
    assert engine.weight_version == 3
    moved = max((t - before[n]).abs().max().item() for n, t in loop.trainer.trained_weights())
    assert moved > 1e-3
    # The engine's version-0 log probabilities of its first samples are no longer the
    # trainer's: the weights changed (and each cycle above found the engine following).
    drift = max(
        (loop.trainer.token_logprobs(g)[0][0, : len(g[0].logprobs)] - torch.tensor(g[0].logprobs))
        .abs()
        .max()
        .item()
        for g in first
    )
    assert drift > 100 * LOGPROB_TOL


async def test_sigkill_mid_rollout_reaches_the_trainer(long_context_dir: Path) -> None:
    """No supervisor: the loop's cycle raises EngineDeadError within 2 s of the kill."""
    before = child_pids()
    client = ProcessEngine(tiny_config(long_context_dir))
    killer = KillDuringRollout(client, at=1, per_rollout=len(PROMPTS))
    seen: list[float] = []
    with anyio.fail_after(TIMEOUT):
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(client.run)
                loop = make_loop(killer, long_context_dir)
                try:
                    async for _ in loop.cycles(3):
                        pass
                except EngineDeadError:
                    seen.append(time.perf_counter())
                    raise
        except* EngineDeadError:
            pass
    assert killer.killed_at is not None and seen, "the loop saw no EngineDeadError"
    assert seen[0] - killer.killed_at < 2.0
    assert loop.trainer.step == 1  # the death came during the second cycle's rollout
    assert child_pids() == before


async def test_supervised_engine_restarts_with_the_last_weights(long_context_dir: Path) -> None:
    before = child_pids()
    supervisor = EngineSupervisor(tiny_config(long_context_dir), RestartPolicy(0.0))
    killer = KillDuringRollout(supervisor, at=1, per_rollout=len(PROMPTS))
    with anyio.fail_after(2 * TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(supervisor.run)
            first_pid = supervisor.pid
            loop = make_loop(killer, long_context_dir)
            rows = [stats async for stats in loop.cycles(3)]
            assert supervisor.pid not in (None, first_pid)
            assert killer.killed_pid == first_pid and os.getpid() != first_pid
            supervisor.stop()
    assert [r.step for r in rows] == [1, 2, 3]
    assert loop.num_restarts == 1 == supervisor.num_restarts
    assert [r.num_restarts for r in rows] == [0, 1, 1]
    # Before: versions 0; after the restart the new engine counts from 0 again: the
    # re-push is its version 1, then one per step.
    assert [r.expected_version for r in rows] == [0, 1, 2]
    for r in rows:
        assert r.weight_versions == [r.expected_version]
        # After the restart the engine agrees with the trainer: it got the pushed weights
        # (the model directory's would differ by far more: see the in-process test).
        assert r.train.logprob_abs_diff_max < LOGPROB_TOL, r.train
    assert child_pids() == before


def test_bench_rl_quick(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``bench rl --quick``: three cycles, every phase timed, versions checked, files out."""
    from tgengine.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "rl",
            "--quick",
            "--model",
            str(tiny_llama_dir),
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.handler(args) == 0
    result = json.loads((tmp_path / "rl.json").read_text())
    summary = result["summary"]
    assert summary["cycles_done"] == 3 and summary["hangs"] == 0
    assert summary["versions_ok"] == 3 == summary["versions_equal_step"]
    assert set(summary["median_s"]) == {
        "generate",
        "sleep",
        "train",
        "wakeup weights",
        "push",
        "wakeup kv_cache",
    }
    assert summary["open_fds_max"] > 0 and summary["logprob_abs_diff_max"] < LOGPROB_TOL
    assert "phase" in (tmp_path / "rl.txt").read_text()
    assert result["machine"]["isa"] == isa()  # every bench figure names its ISA
    assert f"== bench rl ({isa()}) ==" in (tmp_path / "rl.txt").read_text()


def test_a_second_epoch_measures_the_kl_of_the_first(tiny_llama_dir: Path) -> None:
    group = [
        Sample([5, 6, 7], [8, 9, 10], [-1.0] * 3, advantage=1.0),
        Sample([5, 6, 7], [11, 12], [-1.0] * 2, advantage=-1.0),
    ]
    one = Trainer(str(tiny_llama_dir), lr=1e-2).train_step([group])
    two = Trainer(str(tiny_llama_dir), lr=1e-2, epochs=2).train_step([group])
    assert one.kl is None and one.step == two.step == 1 and one.num_tokens == 5
    assert two.kl is not None and two.kl > 0
    assert one.loss == pytest.approx(two.loss)  # the first pass is the same in both
