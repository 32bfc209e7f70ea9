"""RL loops (DESIGN.md §7): requests kept across sleep and weight updates, updates in parts.

A kept greedy request must continue exactly as transformers (float32) continues its prompt
plus the tokens it had when the weights changed; the block accounting must be exact at
every point; every bad input must change nothing.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from tgengine import (
    Engine,
    IllegalStateError,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    open_engine,
)
from tgengine.models import iter_safetensors

from engine_helpers import TIMEOUT, collect, greedy, hf_greedy, tiny_config, tokens_of

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8, 91, 120, 7]
MAX_TOKENS = 40
FIRST = 3  # the request has at least this many tokens when the weights change


class Kept:
    """A greedy request consumed in a task; ``started`` is set once it has FIRST tokens."""

    def __init__(self, engine: Engine, max_tokens: int = MAX_TOKENS) -> None:
        self.engine = engine
        self.params = greedy(max_tokens)
        self.chunks: list[RequestOutput] = []
        self.started = anyio.Event()
        self.done = anyio.Event()

    async def run(self) -> None:
        async for chunk in self.engine.generate(PROMPT, self.params, request_id="kept"):
            self.chunks.append(chunk)
            if len(self.chunks) == FIRST:
                self.started.set()
        self.done.set()

    @property
    def tokens(self) -> list[int]:
        return tokens_of(self.chunks)


def check_blocks(engine: Engine, *, running: int, waiting: int) -> None:
    """The scheduler's queues, and the block accounting exact: every block free."""
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (running, waiting), stats
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    scheduler = engine._loop.scheduler
    assert scheduler is not None
    blocks = scheduler.block_manager
    blocks.check_invariants()
    assert all(b.ref_count == 0 for b in blocks.blocks)


def split_at_version(chunks: list[RequestOutput]) -> tuple[list[int], list[int]]:
    """The tokens before the first chunk of a higher version, and from it on."""
    versions = [c.weight_version for c in chunks]
    assert versions == sorted(versions), versions
    first = next(i for i, v in enumerate(versions) if v > versions[0])
    return tokens_of(chunks[:first]), tokens_of(chunks[first:])


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_keep_continues_the_same_stream(tiny_llama_dir: Path, level: int) -> None:
    want = hf_greedy(tiny_llama_dir, PROMPT, MAX_TOKENS)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            kept = Kept(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.sleep(level, "keep")
                check_blocks(engine, running=0, waiting=1)  # kept, its KV gone with the cache
                memory = engine.memory_stats()["cpu"]
                assert memory.kv_cache_bytes == memory.weights_bytes == 0
                await anyio.wait_all_tasks_blocked()
                frozen, steps = len(kept.chunks), engine.stats().num_steps
                await engine.wakeup(["kv_cache"])  # one tag: still asleep, nothing steps
                await anyio.wait_all_tasks_blocked()
                assert (len(kept.chunks), engine.stats().num_steps) == (frozen, steps)
                await engine.wakeup(["weights"])
            check_blocks(engine, running=0, waiting=0)
            assert engine.stats().num_preemptions_total >= 1
    assert kept.tokens == want, "a token was lost, repeated or changed"
    assert kept.chunks[-1].finish_reason == "length"
    assert all(c.weight_version == 0 for c in kept.chunks[:frozen])
    assert {c.weight_version for c in kept.chunks[frozen:]} == {level - 1}  # 2: reloaded


async def test_the_rl_cycle_recomputes_kept_requests_with_the_new_weights(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, max_num_batched_tokens=4)) as engine:
            kept = Kept(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.sleep(2, "keep")
                await engine.wakeup(["weights"])  # reloaded from disk: version 1
                await engine.update_weights(new)  # version 2, the kept request recomputes
                check_blocks(engine, running=0, waiting=1)
                await engine.wakeup(["kv_cache"])
            queried = engine.stats().prefix_cache_queries_total
    old, later = split_at_version(kept.chunks)
    assert {c.weight_version for c in kept.chunks[len(old) - len(kept.chunks) :]} == {2}
    assert old == hf_greedy(tiny_llama_dir, PROMPT, MAX_TOKENS)[: len(old)]
    # prompt + tokens so far, recomputed (in chunks of 4: chunked prefill) with the new weights
    assert later == hf_greedy(other_dir, PROMPT + old, MAX_TOKENS - len(old))
    assert queried >= len(PROMPT) + len(old)  # the recompute went through the prefix cache


@pytest.mark.parametrize("kept_kv", ["recompute", "reuse"])
async def test_pause_keep_then_update(tiny_llama_dir: Path, other_dir: Path, kept_kv: str) -> None:
    new = list(iter_safetensors(other_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            kept = Kept(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.pause("keep")
                held = engine.stats().num_free_blocks
                await engine.update_weights(new, kept_kv=kept_kv)  # type: ignore[arg-type]
                stats = engine.stats()
                if kept_kv == "recompute":
                    check_blocks(engine, running=0, waiting=1)
                else:  # its KV stays where it is
                    assert (stats.num_running, stats.num_free_blocks) == (1, held)
                await engine.resume()
    old, later = split_at_version(kept.chunks)
    assert len(old) + len(later) == MAX_TOKENS and kept.chunks[-1].finish_reason == "length"
    assert old == hf_greedy(tiny_llama_dir, PROMPT, MAX_TOKENS)[: len(old)]
    if kept_kv == "reuse":
        assert later != hf_greedy(other_dir, PROMPT + old, MAX_TOKENS - len(old))  # off-policy
    else:
        assert later == hf_greedy(other_dir, PROMPT + old, MAX_TOKENS - len(old))
    assert {c.weight_version for c in kept.chunks[len(old) :]} == {1}


async def test_abort_and_stop_end_a_kept_request_while_asleep(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            kept = Kept(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.sleep(1, "keep")
                engine.abort("kept")
                await kept.done.wait()  # at once: no wakeup needed
            assert kept.chunks[-1].finish_reason == "abort"
            assert kept.chunks[-1].weight_version == 0
            check_blocks(engine, running=0, waiting=0)
            await engine.wakeup()
        engine = Engine(tiny_config(tiny_llama_dir))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            kept = Kept(engine)
            tg.start_soon(kept.run)
            await kept.started.wait()
            await engine.sleep(2, "keep")
            engine.stop()
        assert kept.chunks[-1].finish_reason == "abort"
        assert len(kept.tokens) < MAX_TOKENS


async def push_in_parts(engine: Engine, named: list[tuple[str, torch.Tensor]]) -> None:
    async with engine.weight_update() as update:
        for i in range(0, len(named), 3):
            await update.push(named[i : i + 3])


async def test_an_update_in_parts_applies_at_once(tiny_llama_dir: Path, other_dir: Path) -> None:
    new = list(iter_safetensors(other_dir))
    want_new = hf_greedy(other_dir, PROMPT, 8)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = tokens_of(await collect(engine, PROMPT, greedy(8)))
            async with engine.weight_update() as update:
                for i in range(0, len(new), 3):
                    await update.push([(n, t.double()) for n, t in new[i : i + 3]])  # cast
                    # nothing applies before the block ends: a request still sees the old
                    assert engine.weight_version == 0
                assert update.num_staged == len(new)
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new != before


async def test_level_2_pushed_parts_become_the_weights(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    config = tiny_config(tiny_llama_dir, prepack_weights=False)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(config) as engine:
            size = engine.memory_stats()["cpu"].weights_bytes
            await engine.sleep(2)
            async with engine.weight_update() as update:
                for i in range(0, len(new), 3):
                    await update.push(new[i : i + 3])
                staged = {t.untyped_storage().data_ptr() for t in update._staged.values()}
                assert update.staged_bytes == size  # one copy: the weights-to-be
            assert engine.weight_version == 1 and engine.sleeping_tags == {"weights", "kv_cache"}
            await engine.wakeup()
            assert engine.weight_version == 1, "nothing was read from disk"
            agent = engine._executor.agent  # type: ignore[attr-defined]
            params = {p.untyped_storage().data_ptr() for p in agent._model.parameters()}
            assert params == staged, "the pushed tensors are not the weights"
            assert engine.memory_stats()["cpu"].weights_bytes == size
            got = tokens_of(await collect(engine, PROMPT, greedy(8)))
    assert got == hf_greedy(other_dir, PROMPT, 8)


async def test_level_1_update_while_asleep_applies_on_wakeup(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            await engine.sleep(1)
            await engine.update_weights(new)
            await engine.wakeup()
            assert engine.weight_version == 1
            got = tokens_of(await collect(engine, PROMPT, greedy(8)))
    assert got == hf_greedy(other_dir, PROMPT, 8)


BAD_PARTS = {
    "wrong shape": lambda n, t: ((n, t[:1]), f"{n}: shape"),
    "unknown name": lambda n, t: (("model.nope.weight", t), "unknown tensor name 'model.nope"),
    "wrong dtype": lambda n, t: ((n, t.to(torch.int32)), f"{n}: dtype torch.int32"),
    "not finite": lambda n, t: ((n, t * float("nan")), f"{n}: holds NaN"),
}


@pytest.mark.parametrize("bad", list(BAD_PARTS))
async def test_a_bad_part_names_the_tensor_and_changes_nothing(
    tiny_llama_dir: Path, other_dir: Path, bad: str
) -> None:
    new = list(iter_safetensors(other_dir))
    (wrong, culprit) = BAD_PARTS[bad](*new[-1])
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = tokens_of(await collect(engine, PROMPT, greedy(8)))
            with pytest.raises(InvalidRequestError) as raised:
                async with engine.weight_update() as update:
                    await update.push(new[:-1])  # good tensors first: none may apply
                    await update.push([wrong])
            assert culprit in str(raised.value) and raised.value.field == "weights"
            assert update.num_staged == 0 and engine.weight_version == 0
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == before
            await push_in_parts(engine, new)  # the slot is free again
            assert engine.weight_version == 1


async def test_a_cancelled_or_failed_block_applies_nothing(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = tokens_of(await collect(engine, PROMPT, greedy(8)))
            with anyio.CancelScope() as scope:
                async with engine.weight_update() as update:
                    await update.push(new)
                    scope.cancel()
                    await anyio.sleep_forever()
            assert scope.cancelled_caught
            with pytest.raises(KeyError):
                async with engine.weight_update() as update:
                    await update.push(new)
                    raise KeyError("the trainer failed")
            assert engine.weight_version == 0
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == before


async def test_one_update_at_a_time_and_each_commits_once(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = tokens_of(await collect(engine, PROMPT, greedy(8)))
            async with engine.weight_update() as first:
                await first.push(new[:2])
                with pytest.raises(IllegalStateError, match="second weight update"):
                    async with engine.weight_update():
                        pass
                with pytest.raises(IllegalStateError, match="second weight update"):
                    await engine.update_weights(new)
                assert engine.weight_version == 0
                await first.push(new[2:])
            assert engine.weight_version == 1
            with pytest.raises(InvalidRequestError, match="committed"):
                async with first:
                    pass
            with pytest.raises(InvalidRequestError, match="committed"):
                await first.push(new)
            assert engine.weight_version == 1
            await engine.update_weights(tiny_llama_dir)  # back: the slot is free
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == before


async def test_reuse_where_the_kv_is_gone_is_refused_and_changes_nothing(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = list(iter_safetensors(other_dir))
    want = hf_greedy(tiny_llama_dir, PROMPT, MAX_TOKENS)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            kept = Kept(engine)
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.sleep(1, "keep")
                with pytest.raises(InvalidRequestError, match="kept_kv") as raised:
                    await engine.update_weights(new, kept_kv="reuse")
                assert "released the KV cache" in str(raised.value)
                with pytest.raises(InvalidRequestError, match="kept_kv"):
                    async with engine.weight_update(kept_kv="reuse"):
                        pass
                with pytest.raises(InvalidRequestError, match="kept_kv"):
                    engine.weight_update(kept_kv="bogus")  # type: ignore[arg-type]
                assert engine.weight_version == 0
                check_blocks(engine, running=0, waiting=1)
                await engine.wakeup()
    assert kept.tokens == want and kept.chunks[-1].finish_reason == "length"
    assert {c.weight_version for c in kept.chunks} == {0}


async def test_sampled_kept_request_is_unchanged_by_a_keep_sleep(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            want = tokens_of(await collect(engine, PROMPT, params))
            kept = Kept(engine)
            kept.params = params
            async with anyio.create_task_group() as tg:
                tg.start_soon(kept.run)
                await kept.started.wait()
                await engine.sleep(1, "keep")
                await engine.wakeup()
    assert kept.tokens == want  # the seeded generator went on where it was


async def test_level_2_a_partial_update_reads_the_rest_from_disk(tiny_llama_dir: Path) -> None:
    disk = dict(iter_safetensors(tiny_llama_dir))
    pushed = {"model.norm.weight": disk["model.norm.weight"] * 2}
    config = tiny_config(tiny_llama_dir, prepack_weights=False)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(config) as engine:
            await engine.sleep(2)
            async with engine.weight_update() as update:
                await update.push(pushed.items())
            await engine.wakeup()
            assert engine.weight_version == 2  # the update, and the reload of the rest
            agent = engine._executor.agent  # type: ignore[attr-defined]
            params = dict(agent._model.named_parameters())
            for name, want in {**disk, **pushed}.items():
                if name in params:
                    assert torch.equal(params[name].data, want), name
            assert len(tokens_of(await collect(engine, PROMPT, greedy(4)))) == 4
