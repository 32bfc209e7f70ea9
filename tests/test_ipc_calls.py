"""The one call tracker (``ipc.calls``): what the engine process's client and the ``mp``
executor both wait on. No processes: the replies are fed in by hand."""

from __future__ import annotations

import anyio
import pytest

from tgengine.errors import WorkerExited
from tgengine.ipc.calls import CallTracker, Reply

pytestmark = pytest.mark.anyio
TIMEOUT = 5.0


async def test_a_call_is_done_when_every_peer_replied() -> None:
    calls = CallTracker()
    with anyio.fail_after(TIMEOUT), calls.open("step", num_peers=2) as (request, call):
        assert request.command == "step"
        calls.reply(Reply(request.call_id, result="a", elapsed=0.5), peer=1)
        assert not call.done.is_set()
        calls.reply(Reply(request.call_id, result="b", elapsed=0.25), peer=0)
        await call.done.wait()
        assert call.settled.is_set() and call.error is None
    assert call.results_by_peer() == ["b", "a"] and call.elapsed == 0.5
    assert calls.get(request.call_id) is None, "a call is tracked only while open"


async def test_the_first_error_ends_the_wait_and_a_lost_peer_is_the_cause() -> None:
    calls = CallTracker()
    lost = WorkerExited(1, 42, -9)
    with anyio.fail_after(TIMEOUT), calls.open("step", num_peers=2) as (request, call):
        calls.reply(Reply(request.call_id, error=RuntimeError("collective broke")), peer=0)
        await call.done.wait()
        assert not call.settled.is_set()  # rank 1 has not answered yet
        calls.fail_all(1, lambda: lost, lost=True)
        await call.settled.wait()
    assert call.error is lost


async def test_a_reply_after_its_caller_left_is_dropped() -> None:
    calls = CallTracker()
    with calls.open("pause") as (request, call):
        pass
    calls.reply(Reply(request.call_id, result=1))
    assert not call.done.is_set() and call.results == {}


async def test_fail_all_gives_each_call_its_own_error() -> None:
    calls = CallTracker()
    with anyio.fail_after(TIMEOUT), calls.open("a") as (_, first), calls.open("b") as (_, second):
        calls.fail_all(0, lambda: RuntimeError("gone"))
        await first.done.wait()
        await second.done.wait()
    assert first.error is not second.error
    assert str(first.error) == str(second.error) == "gone"
