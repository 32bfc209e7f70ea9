"""Graceful stop on SIGINT/SIGTERM for the dev runner (the library installs no handlers)."""

from __future__ import annotations

import signal
import sys

import anyio

from ..engine.client import EngineClient


async def stop_on_signals(engine: EngineClient, scope: anyio.CancelScope, grace: float) -> None:
    """First SIGINT/SIGTERM: ``engine.stop(grace)``; a second one cancels ``scope`` at once.

    Returns only when cancelled or after the second signal.
    """
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        stopping = False
        async for signum in signals:
            name = signal.Signals(signum).name
            if stopping:
                print(f"\n{name} again: stopping now", file=sys.stderr, flush=True)
                scope.cancel()
                return
            stopping = True
            print(f"\n{name}: stopping (grace {grace:g} s)", file=sys.stderr, flush=True)
            engine.stop(grace)
