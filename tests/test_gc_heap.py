"""``runtime.gc_heap``: the processes tgengine owns freeze their start-up objects once the
engine serves, so that ``sleep()``'s full collection does not walk them every time."""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from anyio.abc import UNIXSocketStream

from tgengine.config import EngineConfig
from tgengine.ipc.wire import Channel
from tgengine.process import child
from tgengine.process.messages import Setup
from tgengine.runtime.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process's heap is left as it was found: nothing frozen."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_garbage_is_collected_before_what_lives_is_frozen(unfrozen: None) -> None:
    live = Node()
    cycle_a, cycle_b = Node(), Node()
    cycle_a.other, cycle_b.other = cycle_b, cycle_a  # garbage that only a collection frees
    dead = weakref.ref(cycle_a)
    del cycle_a, cycle_b
    gc.disable()  # no collection of its own may run between here and the call
    try:
        assert dead() is not None
        frozen = freeze_startup_heap()
    finally:
        gc.enable()
    assert dead() is None, "the cycle was frozen instead of collected"
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is live for o in gc.get_objects()), "a live object is still collectable"
    later = Node()
    assert any(o is later for o in gc.get_objects()), "objects made afterwards are not frozen"


@pytest.mark.anyio
async def test_the_engine_process_freezes_its_heap_once_the_engine_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hosted: list[dict[str, Any]] = []

    class Host:
        def __init__(self, engine: object, channel: Channel, **kwargs: Any) -> None:
            hosted.append(kwargs)

        async def run(self) -> None:
            return None

    monkeypatch.setattr(child, "Engine", lambda config, executor=None: object())
    monkeypatch.setattr(child, "EngineHost", Host)
    parent_sock, child_sock = socket.socketpair()
    with anyio.fail_after(10):
        parent = Channel(await UNIXSocketStream.from_socket(parent_sock))
        try:
            await parent.send([Setup(EngineConfig(model="unused"))])
            assert await child.serve_parent(child_sock) is None
        finally:
            await parent.aclose()
    assert hosted == [{"on_ready": freeze_startup_heap}]
