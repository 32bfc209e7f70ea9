"""Weight updates in parts packed as they arrive, while the weights sleep at level 2.

Where bf16 weights pack as pair panels (AVX-512 BF16), each pushed linear weight is written
into its new panels at once (``agent.packed_parts``) instead of waiting whole for the
commit. Whatever the order of parts, repeats, wakeups before the commit, cancellations and
bad parts, the weights after the wakeup must be exactly what the parts said (every other
weight as on disk), bit for bit, in their packed form.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.abc
import pytest
import torch

from tgengine import Engine, InvalidRequestError, open_engine
from tgengine.models import iter_safetensors

from engine_helpers import TIMEOUT, collect, greedy, tiny_config, tokens_of
from kernel_helpers import require_avx512_bf16

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8, 91, 120, 7]
Named = list[tuple[str, torch.Tensor]]


@pytest.fixture(autouse=True)
def _pairs() -> None:
    require_avx512_bf16()  # elsewhere bf16 weights are not pair panels: nothing is absorbed


def bf16(model_dir: Path) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in iter_safetensors(model_dir)}


def weights_now(engine: Engine) -> dict[str, torch.Tensor]:
    """Every parameter's value as the engine computes with it, read back from its packed
    form where it has one (and asserting that every linear weight is pair panels)."""
    model = engine._executor.agent._model  # type: ignore[attr-defined]
    ids = {id(p): name for name, p in model.named_parameters()}
    values = {name: p.data for name, p in model.named_parameters()}
    for weights in model.linear_weights():
        assert weights.packed is not None and weights.packed.pair_cols is not None
        dense, row = weights.packed.to_dense(), 0
        for p in weights.params:
            values[ids[id(p)]] = dense[row : row + p.shape[0]]
            row += p.shape[0]
    return values


def assert_weights(engine: Engine, want: dict[str, torch.Tensor]) -> None:
    now = weights_now(engine)
    for name, value in now.items():
        assert torch.equal(value, want[name]), name


async def staged_bytes_asleep(engine: Engine, parts: list[Named]) -> int:
    async with engine.weight_update() as update:
        for part in parts:
            await update.push(part)
        staged = update.staged_bytes
    return staged


class Absorbing:
    def __init__(self, absorb: object, drop: object) -> None:
        self.absorb, self.drop = absorb, drop


def in_parts(named: Named, size: int) -> list[Named]:
    return [named[i : i + size] for i in range(0, len(named), size)]


async def test_level_2_parts_become_packed_weights_as_they_arrive(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = bf16(other_dir)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, dtype="bfloat16")) as engine:
            size = engine.memory_stats()["cpu"].weights_bytes
            await engine.sleep(2)
            staged = await staged_bytes_asleep(engine, in_parts(list(new.items()), 3))
            # only what is not a linear weight waits for the commit (norms, the embedding
            # where it is not the head): the linear weights are packed already
            assert staged < size / 4, (staged, size)
            await engine.wakeup()
            assert engine.weight_version == 1, "nothing was read from disk"
            assert_weights(engine, new)
            got = tokens_of(await collect(engine, PROMPT, greedy(8)))
        async with open_engine(tiny_config(other_dir, dtype="bfloat16")) as fresh:
            assert_weights(fresh, new)
            assert got == tokens_of(await collect(fresh, PROMPT, greedy(8)))


async def test_level_2_a_partial_update_keeps_the_rest_from_disk(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    disk, new = bf16(tiny_llama_dir), bf16(other_dir)
    names = [n for n in new if "layers.0.self_attn.k_proj" in n or "layers.1.mlp.up_proj" in n]
    names += ["model.norm.weight"]
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, dtype="bfloat16")) as engine:
            await engine.sleep(2)
            async with engine.weight_update() as update:
                await update.push([(n, new[n].float()) for n in names])  # cast as they pack
            await engine.wakeup()
            assert_weights(engine, {**disk, **{n: new[n] for n in names}})


async def test_a_repeat_a_wakeup_before_the_commit_and_a_second_update(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    disk, new = bf16(tiny_llama_dir), bf16(other_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    gate = "model.layers.1.mlp.gate_proj.weight"
    up = "model.layers.1.mlp.up_proj.weight"  # packed with gate: one weight, two updates
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, dtype="bfloat16")) as engine:
            await engine.sleep(2)
            async with engine.weight_update() as update:
                await update.push([(q, new[q] * 3)])  # absorbed
                await update.push([(q, new[q])])  # the later value wins
                await update.push(list(new.items())[:10])
                await engine.wakeup()  # the weights come back from disk; then the commit
            assert_weights(engine, {**disk, **dict(list(new.items())[:10]), q: new[q]})
            await engine.sleep(2)
            async with engine.weight_update() as update:  # two updates while asleep
                await update.push([(gate, new[gate])])
            async with engine.weight_update() as update:
                await update.push([(q, disk[q] * 2), (up, new[up])])
            await engine.wakeup()
            want = {**disk, gate: new[gate], up: new[up], q: disk[q] * 2}
            assert_weights(engine, want)


async def test_a_cancelled_or_refused_part_counts_for_nothing(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    disk, new = bf16(tiny_llama_dir), bf16(other_dir)
    v = "model.layers.0.self_attn.v_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    bad = new[down].clone()
    bad[3, 4] = float("nan")
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, dtype="bfloat16")) as engine:
            await engine.sleep(2)
            async with engine.weight_update() as update:
                absorber = update._absorber
                assert absorber is not None
                with anyio.CancelScope() as scope:

                    async def absorb_then_cancel(named: Named) -> list[str]:
                        taken = await absorber.absorb(named)
                        assert taken == [v]  # packed already, then cancelled
                        scope.cancel()
                        return taken

                    update._absorber = Absorbing(absorb_then_cancel, absorber.drop)
                    await update.push([(v, new[v])])  # cancelled: counts for nothing
                assert scope.cancelled_caught
                update._absorber = absorber
                with pytest.raises(InvalidRequestError, match="NaN"):
                    await update.push([(v, new[v]), (down, bad)])  # refused whole
                assert update.num_staged == 0
            await engine.wakeup()
            assert engine.weight_version == 2  # the empty update, then the reload
            assert_weights(engine, disk)
            await engine.sleep(2)
            with pytest.raises(KeyError):
                async with engine.weight_update() as update:
                    await update.push(list(new.items()))
                    raise KeyError("the trainer failed")
            await engine.wakeup()
            assert_weights(engine, disk)


async def test_an_update_open_when_the_engine_stops_ends_cleanly(
    tiny_llama_dir: Path, other_dir: Path
) -> None:
    new = bf16(other_dir)
    engine = Engine(tiny_config(tiny_llama_dir, dtype="bfloat16"))
    stopped = anyio.Event()

    async def serve(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        await engine.run(task_status=task_status)
        stopped.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(serve)
            await engine.sleep(2)
            agent = engine._executor.agent  # type: ignore[attr-defined]
            with pytest.raises(KeyError):
                async with engine.weight_update() as update:
                    await update.push(list(new.items())[:6])
                    assert agent._pending.groups  # absorbed, waiting for the commit
                    engine.stop()
                    await stopped.wait()  # its compute thread is gone
                    raise KeyError("the trainer failed after the engine stopped")
            assert not agent._pending.groups
