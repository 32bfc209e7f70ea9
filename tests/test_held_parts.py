"""Parts held, not read: ``push_file(path, hold=True)`` and ``parts/shared`` with ``hold``.

The engine maps a held part's file and stages its tensors as views of it, so the file's
pages in /dev/shm are the one copy of what was pushed; the writer leaves it as it is until
the update ends (it may remove it). A held file written before the commit fails the commit,
and nothing applies; tensors the executor keeps for a wakeup are copied at the commit, so
the writer may use the file again once the commit answered.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from server_helpers import ADMIN_KEY, TIMEOUT, completion_body, running_server
from tgengine import Engine, InvalidRequestError
from tgengine.ipc import weights_file
from tgengine.ipc.weights_file import write_weights_file
from tgengine.models import iter_safetensors

from engine_helpers import collect, greedy, hf_greedy, tiny_config, tokens_of
from process_helpers import child_pids

pytestmark = pytest.mark.anyio
PROMPT = [5, 17, 29, 3, 44, 8, 91, 120, 7]
UPDATES = "/weights/updates"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory in /dev/shm for the trainer's part files, removed after the test."""
    directory = weights_file.new_weights_dir()
    yield directory
    weights_file.remove_weights_dir(directory)


def write_parts(model_dir: Path, shared: Path, size: int = 3) -> list[Path]:
    """``model_dir``'s tensors as part files in ``shared``, ``size`` tensors each."""
    named = list(iter_safetensors(model_dir))
    files = []
    for i in range(0, len(named), size):
        files.append(shared / f"part-{i // size}.safetensors")
        write_weights_file(named[i : i + size], files[-1])
    return files


def rewrite(file: Path, model_dir: Path) -> None:
    """Write ``file`` again with ``model_dir``'s tensors of the same names (other values,
    same size): its modification time changes."""
    names = {name for name, _ in weights_file.map_weights(file)}
    before = file.stat().st_mtime_ns
    write_weights_file([(n, t) for n, t in iter_safetensors(model_dir) if n in names], file)
    if file.stat().st_mtime_ns == before:  # a coarse clock: move it on by hand
        os.utime(file, ns=(before + 1000, before + 1000))


async def test_held_parts_apply_and_a_file_written_before_the_commit_fails_it(
    tiny_llama_dir: Path, other_dir: Path, shared: Path
) -> None:
    want_new = hf_greedy(other_dir, PROMPT, 8)
    engine = Engine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            old = tokens_of(await collect(engine, PROMPT, greedy(8)))
            assert old != want_new

            files = write_parts(other_dir, shared)
            async with engine.weight_update() as update:
                for file in files:
                    await update.push_file(file, hold=True)
                files[0].unlink()  # removing a held file is fine: its pages stay mapped
                assert engine.weight_version == 0
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new

            # a held file written before the commit: the commit fails, nothing applies
            files = write_parts(tiny_llama_dir, shared)
            with pytest.raises(InvalidRequestError, match="written after it was pushed"):
                async with engine.weight_update() as update:
                    for file in files:
                        await update.push_file(file, hold=True)
                    rewrite(files[1], other_dir)
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new

            # a held file that is not safetensors: refused, the update stays usable
            (shared / "junk").write_bytes(b"\x10" + bytes(40))
            files = write_parts(tiny_llama_dir, shared)
            async with engine.weight_update() as update:
                with pytest.raises(InvalidRequestError, match="not a safetensors file"):
                    await update.push_file(shared / "junk", hold=True)
                for file in files:
                    await update.push_file(file, hold=True)
            assert engine.weight_version == 2
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == old
            tg.cancel_scope.cancel()


async def test_held_tensors_kept_for_a_wakeup_are_copied_at_the_commit(
    tiny_llama_dir: Path, other_dir: Path, shared: Path
) -> None:
    """With the weights asleep the commit keeps the tensors for the wakeup; the writer
    uses its files again once the commit answered, and the wakeup still gets what was
    pushed."""
    want_new = hf_greedy(other_dir, PROMPT, 8)
    engine = Engine(tiny_config(tiny_llama_dir))
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.sleep(2)
            files = write_parts(other_dir, shared)
            async with engine.weight_update() as update:
                for file in files:
                    await update.push_file(file, hold=True)
            for file in files:  # the next update's parts, written over the same files
                rewrite(file, tiny_llama_dir)
            await engine.wakeup()
            assert engine.weight_version == 1
            assert tokens_of(await collect(engine, PROMPT, greedy(8))) == want_new
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["server", "engine process"])
async def test_held_parts_over_http(
    tiny_llama_dir: Path, other_dir: Path, shared: Path, where: str
) -> None:
    """``parts/shared`` with ``"hold": true``: the engine (in the server's process or in
    its own) maps each file until the commit; one written meanwhile fails the commit (400),
    and nothing applies."""
    want_new = hf_greedy(other_dir, PROMPT, 8)
    before_pids = child_pids()
    body = completion_body(PROMPT, ignore_eos=True)

    async def text(http: httpx.AsyncClient) -> str:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    async def post_held(http: httpx.AsyncClient, model_dir: Path) -> tuple[str, list[Path]]:
        update_id = (await http.post(UPDATES)).json()["id"]
        files = write_parts(model_dir, shared)
        for i, file in enumerate(files):
            route = f"{UPDATES}/{update_id}/parts/shared"
            sent = await http.post(route, json={"path": str(file), "hold": True})
            assert sent.status_code == 200, sent.text
            assert sent.json()["num_parts"] == i + 1
        return update_id, files

    with anyio.fail_after(2 * TIMEOUT):
        own_process = where == "engine process"
        async with running_server(
            tiny_llama_dir, own_process=own_process, admin_key=ADMIN_KEY
        ) as r:
            engine = r.engine
            async with r.client(ADMIN_KEY) as http:
                old = await text(http)
                update_id, files = await post_held(http, other_dir)
                assert await text(http) == old  # nothing applies before the commit
                files[-1].unlink()
                committed = await http.post(f"{UPDATES}/{update_id}/commit")
                assert committed.status_code == 200, committed.text
                assert committed.json()["weight_version"] == 1
                new = await text(http)

                update_id, files = await post_held(http, tiny_llama_dir)
                rewrite(files[0], other_dir)
                refused = await http.post(f"{UPDATES}/{update_id}/commit")
                assert refused.status_code == 400, refused.text
                assert "written after it was pushed" in refused.json()["error"]["message"]
                status = (await http.get(f"{UPDATES}/{update_id}")).json()
                assert status["state"] == "aborted" and status["weight_version"] == 1
                assert await text(http) == new
    assert new == engine.tokenizer.decode(want_new)
    assert child_pids() == before_pids
