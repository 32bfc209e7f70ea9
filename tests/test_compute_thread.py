"""``agent.compute_thread.ComputeThread``: every call on one OS thread, in order, its errors
raised to the caller; a call from that thread runs at once; ``close`` ends the thread.
``run`` awaits a call from the event loop: cancelled, it waits for the call, or with
``abandon`` returns at once while the call finishes on its own (after the loop ended too)."""

from __future__ import annotations

import threading
from functools import partial

import anyio
import pytest

from tgengine.agent.compute_thread import ComputeThread

pytestmark = pytest.mark.anyio


async def test_calls_from_changing_worker_threads_run_on_one_thread() -> None:
    compute = ComputeThread()
    callers: set[int] = set()
    ran_on: set[int] = set()

    def job() -> int:
        ran_on.add(threading.get_ident())
        return threading.get_ident()

    def from_worker() -> int:
        callers.add(threading.get_ident())
        return compute.call(job)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:  # several anyio workers at once
                for _ in range(6):
                    tg.start_soon(anyio.to_thread.run_sync, from_worker)
        assert len(callers) > 1, "the calls came from several threads"
        assert len(ran_on) == 1 and threading.get_ident() not in ran_on
        # A call made on the compute thread itself runs at once (no deadlock).
        inner = compute.call(lambda: compute.call(threading.get_ident))
        assert {inner} == ran_on
        with pytest.raises(ValueError, match="boom"):
            compute.call(_raise, ValueError("boom"))
    finally:
        with anyio.fail_after(30):
            ended = await anyio.to_thread.run_sync(compute.close, 30.0)
    assert ended and not any(t.ident in ran_on for t in threading.enumerate())
    with pytest.raises(RuntimeError):
        compute.call(threading.get_ident)  # closed


async def test_run_awaits_calls_on_the_compute_thread_and_cancels_as_asked() -> None:
    compute = ComputeThread()
    release = threading.Event()
    entered = threading.Event()
    finished: list[str] = []

    def blocked(name: str) -> str:
        entered.set()
        release.wait(30)
        finished.append(name)
        return name

    try:
        with anyio.fail_after(30):
            ident = await compute.run(threading.get_ident)
            assert ident != threading.get_ident()
            assert await compute.run(threading.get_ident) == ident  # always the same thread
            with pytest.raises(ValueError, match="boom"):
                await compute.run(_raise, ValueError("boom"))

            with anyio.CancelScope() as scope:  # abandoned: returns at once
                async with anyio.create_task_group() as tg:
                    tg.start_soon(partial(compute.run, blocked, "abandoned", abandon=True))
                    await anyio.to_thread.run_sync(entered.wait)
                    scope.cancel()
            assert scope.cancelled_caught and finished == []
            release.set()
            assert await compute.run(lambda: list(finished)) == ["abandoned"]  # in order

            release.clear()
            entered.clear()
            returned = anyio.Event()

            async def waited() -> None:
                try:
                    await compute.run(blocked, "waited")
                finally:
                    returned.set()

            with anyio.CancelScope() as scope:  # not abandoned: waits for the call
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waited)
                    await anyio.to_thread.run_sync(entered.wait)
                    scope.cancel()
                    with anyio.CancelScope(shield=True):
                        await anyio.wait_all_tasks_blocked()  # cancelled, and still waiting
                        assert not returned.is_set()
                        release.set()
            assert scope.cancelled_caught and finished == ["abandoned", "waited"]
    finally:
        release.set()
        with anyio.fail_after(30):
            assert await anyio.to_thread.run_sync(compute.close, 30.0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_call_abandoned_by_a_loop_that_ended_finishes_quietly(backend: str) -> None:
    compute = ComputeThread()
    release = threading.Event()
    entered = threading.Event()

    def blocked() -> str:
        entered.set()
        release.wait(30)
        return "done"

    async def main() -> None:
        with anyio.move_on_after(30) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(compute.run, blocked, abandon=True))
                await anyio.to_thread.run_sync(entered.wait)
                tg.cancel_scope.cancel()
        assert not scope.cancelled_caught

    anyio.run(main, backend=backend)  # the loop is gone when the call returns
    release.set()
    assert compute.call(lambda: "next") == "next"  # the thread lives on, unharmed
    assert compute.close(30.0)


def _raise(error: Exception) -> None:
    raise error
