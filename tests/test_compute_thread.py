"""``agent.compute_thread.ComputeThread``: every call on one OS thread, in order, its errors
raised to the caller; a call from that thread runs at once; ``close`` ends the thread."""

from __future__ import annotations

import threading

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


def _raise(error: Exception) -> None:
    raise error
