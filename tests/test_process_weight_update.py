"""Updates in parts, keep-sleep and kept_kv with the engine in its own process (issue 32).

Each part crosses as a safetensors file in shared memory, never as pickled tensors; the
engine process pushes it into its own ``Engine.weight_update()``. One engine process per
backend runs every scenario (a start costs seconds of CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest
import torch

from tgengine import IllegalStateError, InvalidRequestError, ProcessEngine, RequestOutput
from tgengine.ipc import weights_file
from tgengine.models import iter_safetensors

from engine_helpers import TIMEOUT, collect, greedy, hf_greedy, tiny_config, tokens_of
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8, 91, 120, 7]


def part_files() -> set[Path]:
    return set(weights_file.SHARED_MEMORY.glob("tgengine-weights-*"))


class Pickles:
    """Fails the test if a tensor is pickled on its way to the engine process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(*args: object) -> None:
            raise AssertionError("a tensor was pickled")

        monkeypatch.setattr(torch.Tensor, "__reduce_ex__", refuse)


async def test_parts_through_shared_memory(
    tiny_llama_dir: Path, other_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = list(iter_safetensors(other_dir))
    want_new = hf_greedy(other_dir, PROMPT, 8)
    before_pids, before_files = child_pids(), part_files()
    engine = ProcessEngine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(2 * TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            Pickles(monkeypatch)
            old = tokens_of(await collect(engine, PROMPT, greedy(8)))  # type: ignore[arg-type]
            assert old != want_new

            # parts, applied at once on a clean exit
            async with engine.weight_update() as update:
                for i in range(0, len(new), 3):
                    await update.push([(n, t.double()) for n, t in new[i : i + 3]])  # cast
                    assert engine.weight_version == 0
                    assert len(part_files() - before_files) == 1, "one file serves every part"
            assert part_files() == before_files, "a part's file was left behind"
            assert engine.weight_version == 1 and update.num_parts == -(-len(new) // 3)
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new  # type: ignore[arg-type]

            # a bad part names the tensor; the block raising applies nothing
            name, tensor = new[-1]
            with pytest.raises(InvalidRequestError, match=re.escape(f"{name}: shape")) as raised:
                async with engine.weight_update() as update:
                    await update.push(list(iter_safetensors(tiny_llama_dir)))
                    await update.push([(name, tensor[:1])])
            assert raised.value.field == "weights"
            with pytest.raises(InvalidRequestError, match=r"unknown tensor name 'model\.nope"):
                async with engine.weight_update() as update:
                    await update.push([("model.nope.weight", tensor)])
            with pytest.raises(KeyError):
                async with engine.weight_update() as update:
                    await update.push(list(iter_safetensors(tiny_llama_dir)))
                    raise KeyError("the trainer failed")
            with anyio.CancelScope() as scope:
                async with engine.weight_update() as update:
                    await update.push(list(iter_safetensors(tiny_llama_dir)))
                    scope.cancel()
                    await anyio.sleep_forever()
            assert scope.cancelled_caught
            with pytest.raises(InvalidRequestError, match="abandoned"):
                await update.push(new)
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new  # type: ignore[arg-type]

            # one update at a time; each commits once
            async with engine.weight_update() as first:
                with pytest.raises(IllegalStateError, match="second weight update"):
                    async with engine.weight_update():
                        pass
                await first.push(list(iter_safetensors(tiny_llama_dir)))
            assert engine.weight_version == 2
            with pytest.raises(InvalidRequestError, match="committed"):
                await first.push(new)
            with pytest.raises(InvalidRequestError, match="committed"):
                async with first:
                    pass
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == old  # type: ignore[arg-type]
            assert part_files() == before_files
            engine.stop()
    assert child_pids() == before_pids


class Kept:
    def __init__(self, engine: ProcessEngine, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.chunks: list[RequestOutput] = []
        self.started = anyio.Event()

    async def run(self) -> None:
        stream = self.engine.generate(PROMPT, greedy(self.max_tokens), request_id="kept")
        async for chunk in stream:
            self.chunks.append(chunk)
            if len(tokens_of(self.chunks)) >= 3:
                self.started.set()


@pytest.mark.parametrize("kept_kv", ["recompute", "reuse"])
async def test_keep_sleep_and_kept_kv_across_the_process(
    tiny_llama_dir: Path, other_dir: Path, kept_kv: str
) -> None:
    """The RL cycle (recompute), or pause('keep') and an update that reuses the KV."""
    new = list(iter_safetensors(other_dir))
    before = child_pids()
    engine = ProcessEngine(tiny_config(tiny_llama_dir))
    kept = Kept(engine, 40)
    with anyio.fail_after(2 * TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            async with anyio.create_task_group() as requests:
                requests.start_soon(kept.run)
                await kept.started.wait()
                if kept_kv == "recompute":
                    await engine.sleep(2, "keep")
                    with pytest.raises(InvalidRequestError, match="kept_kv"):
                        await engine.update_weights(new, kept_kv="reuse")
                    await engine.wakeup(["weights"])
                    async with engine.weight_update() as update:
                        await update.push(new[:4])
                        await update.push(new[4:])
                    await engine.wakeup(["kv_cache"])
                else:
                    await engine.pause("keep")
                    await engine.update_weights(new, kept_kv="reuse")
                    await engine.resume()
            final_version = engine.weight_version
            engine.stop()
    assert child_pids() == before
    versions = [c.weight_version for c in kept.chunks]
    # a level-2 wakeup of the weights reads them from disk: a version of its own
    assert versions == sorted(versions) and versions[-1] == final_version > 0, versions
    assert kept.chunks[-1].finish_reason == "length"
    first_new = next(i for i, v in enumerate(versions) if v > 0)
    had = tokens_of(kept.chunks[:first_new])
    assert len(had) >= 3 and len(tokens_of(kept.chunks)) == 40  # none lost or repeated
    if kept_kv == "recompute":  # as a fresh request of the new weights from there on
        rest = hf_greedy(other_dir, PROMPT + had, 40 - len(had))
        assert tokens_of(kept.chunks[first_new:]) == rest
