"""An update in parts with the ``mp`` executor at size 2: each rank takes only its shard.

The committed parts reach the ranks as one safetensors file in ``/dev/shm``; each rank maps
it and copies out its shard, never reading a full tensor into its own memory (the agent
below refuses tensors that are private copies, so a rank that read the file fails it).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from tgengine import Engine, InvalidRequestError
from tgengine.agent.agent import ModelAgent
from tgengine.executor.mp_executor import MPExecutor
from tgengine.models import iter_safetensors

from engine_helpers import (
    TIMEOUT,
    generate_all,
    greedy,
    hf_greedy,
    make_prompts,
    tiny_config,
    tokens_of,
)
from model_factory import make_tiny_model_dir
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
MAX_TOKENS = 6


def shared_file_ranges() -> list[tuple[int, int]]:
    """The address ranges where this process maps a weights file of ``/dev/shm``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "tgengine-weights-" in fields[5]:
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


class ShardTakingAgent(ModelAgent):
    """A rank's agent that refuses full tensors held in its own memory: every tensor it is
    given must lie in its mapping of the shared file."""

    def _update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._in_shared_file(named)
        super()._update_weights(named)

    async def stage_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._in_shared_file(named)
        await super().stage_weights(named)

    def _in_shared_file(self, named: list[tuple[str, torch.Tensor]]) -> None:
        ranges = shared_file_ranges()
        for name, tensor in named:
            address = tensor.data_ptr()
            if not any(start <= address < end for start, end in ranges):
                rank = self.parallel.rank
                raise AssertionError(f"rank {rank} holds a private copy of the full {name}")


async def test_each_rank_takes_only_its_shard(tiny_llama_dir: Path, tmp_path: Path) -> None:
    new_dir = make_tiny_model_dir(tmp_path, arch="llama", seed=1)
    prompts = make_prompts(vocab_size=384, count=2)
    want = [hf_greedy(new_dir, p, MAX_TOKENS) for p in prompts]
    named = list(iter_safetensors(new_dir))
    config = tiny_config(tiny_llama_dir, executor="mp", tensor_parallel_size=2)
    before = child_pids()
    engine = Engine(config, executor=MPExecutor(config, agent_factory=ShardTakingAgent))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            old = [tokens_of(r) for r in await generate_all(engine, prompts, greedy(MAX_TOKENS))]
            assert old != want
            with pytest.raises(InvalidRequestError, match="q_proj"):
                async with engine.weight_update() as update:
                    await update.push(named[:3])
                    await update.push([(n, t[:1]) for n, t in named if "q_proj" in n])
            assert engine.weight_version == 0
            async with engine.weight_update() as update:
                for i in range(0, len(named), 4):
                    await update.push(named[i : i + 4])
            assert engine.weight_version == 1
            got = [tokens_of(r) for r in await generate_all(engine, prompts, greedy(MAX_TOKENS))]
            tg.cancel_scope.cancel()
    assert got == want
    assert child_pids() == before


def shared_weight_dirs() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("tgengine-weights-*")}


@pytest.mark.parametrize("level", [1, 2])
async def test_updates_committed_asleep_apply_in_order_at_the_weights_wakeup(
    tiny_llama_dir: Path, tmp_path: Path, level: int
) -> None:
    first = list(iter_safetensors(make_tiny_model_dir(tmp_path / "a", arch="llama", seed=2)))
    new_dir = make_tiny_model_dir(tmp_path / "b", arch="llama", seed=1)
    prompts = make_prompts(vocab_size=384, count=2)
    want = [hf_greedy(new_dir, p, MAX_TOKENS) for p in prompts]
    named = list(iter_safetensors(new_dir))
    config = tiny_config(tiny_llama_dir, executor="mp", tensor_parallel_size=2)
    before, files = child_pids(), shared_weight_dirs()
    engine = Engine(config, executor=MPExecutor(config, agent_factory=ShardTakingAgent))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.sleep(level)
            for update_named in (first, named):  # the later one must win
                async with engine.weight_update() as update:
                    for i in range(0, len(update_named), 4):
                        await update.push(update_named[i : i + 4])
            assert engine.weight_version == 2
            assert len(shared_weight_dirs() - files) == 2  # they wait there, asleep
            await engine.wakeup(["weights"])
            assert engine.weight_version == 2  # the staged sets hold every weight: no reload
            assert shared_weight_dirs() == files
            await engine.wakeup(["kv_cache"])
            got = [tokens_of(r) for r in await generate_all(engine, prompts, greedy(MAX_TOKENS))]
            tg.cancel_scope.cancel()
    assert got == want
    assert child_pids() == before
    assert shared_weight_dirs() == files


@pytest.mark.parametrize("whole", [True, False])
async def test_a_level_2_wakeup_reads_from_disk_only_what_the_staged_update_lacks(
    tiny_llama_dir: Path, tmp_path: Path, whole: bool
) -> None:
    """One rank: the weights wake from an update committed asleep at level 2 as an
    in-process engine's do. A whole set becomes the weights (``weight_version`` 1: nothing
    was reloaded); a partial one leaves the rest to the model directory (a reload: 2)."""
    new_dir = make_tiny_model_dir(tmp_path / "b", arch="llama", seed=1)
    named = list(iter_safetensors(new_dir))
    if not whole:
        named = [(n, t) for n, t in named if n.startswith("model.layers.0.")]
    prompts = make_prompts(vocab_size=384, count=2)

    async def cycle(executor: str) -> tuple[list[int], list[list[int]]]:
        engine = Engine(tiny_config(tiny_llama_dir, executor=executor))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.sleep(2)
            await engine.update_weights(named)
            versions = [engine.weight_version]
            await engine.wakeup()
            versions.append(engine.weight_version)
            got = [tokens_of(r) for r in await generate_all(engine, prompts, greedy(MAX_TOKENS))]
            tg.cancel_scope.cancel()
        return versions, got

    before, files = child_pids(), shared_weight_dirs()
    with anyio.fail_after(TIMEOUT):
        in_process = await cycle("uni")
        workers = await cycle("mp")
    assert workers == in_process
    assert workers[0] == ([1, 1] if whole else [1, 2])
    if whole:
        assert workers[1] == [hf_greedy(new_dir, p, MAX_TOKENS) for p in prompts]
    assert child_pids() == before
    assert shared_weight_dirs() == files
