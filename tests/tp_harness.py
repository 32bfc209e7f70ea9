"""A bare tensor-parallel group for model tests: N spawned ranks, each a ``ModelAgent``.

Each rank joins one gloo group once (process start and the rendezvous are the slow part) and
then serves agents one after another: ``load(config)`` starts a ``ModelAgent(config,
parallel=...)`` on every rank, ``call(method, arg)`` runs the same agent method on every rank
and returns each rank's answer, ``unload()`` stops the agents. Plain synchronous calls over
pipes, every wait bounded; the executors (``MPExecutor``) do this for real.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import anyio

TIMEOUT = 60.0


class RankError(Exception):
    """A rank raised: its exception's type and message, and its traceback."""


class RankGroup:
    def __init__(self, world_size: int) -> None:
        from tgengine.parallel import free_port

        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(rank, world_size, init_method, child), daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def load(
        self, config: Any, cache_not_ready: dict[int, dict[int, set[str]]] | None = None
    ) -> list[Any]:
        """Start every rank's agent on ``config``; each rank's ``AgentInfo``.

        ``cache_not_ready``: ``{rank: {step: seq ids}}`` whose cache that rank finds not ready.
        """
        faults = cache_not_ready or {}
        return self._all("load", [(config, faults.get(r)) for r in range(len(self.conns))])

    def call(self, method: str, arg: Any = None, *, raise_errors: bool = True) -> list[Any]:
        """``method(arg)`` on every rank's agent; each rank's answer (or ``RankError``)."""
        return self._all(method, [arg] * len(self.conns), raise_errors)

    def call_each(self, method: str, args: list[Any]) -> list[Any]:
        """``method(args[rank])`` on every rank's agent; each rank's answer."""
        return self._all(method, args)

    def unload(self) -> None:
        self.call("unload")

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("exit", None))
        for proc in self.procs:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)

    def _all(self, method: str, args: list[Any], raise_errors: bool = True) -> list[Any]:
        for conn, arg in zip(self.conns, args, strict=True):
            conn.send((method, arg))
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(TIMEOUT):
                raise TimeoutError(f"rank {rank} did not answer {method!r} in {TIMEOUT} s")
            answers.append(conn.recv())
        failed = [a for a in answers if isinstance(a, RankError)]
        if failed and raise_errors:
            raise failed[0]
        return answers


def _rank_main(rank: int, world_size: int, init_method: str, conn: Connection) -> None:
    import torch

    from tgengine.parallel import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    parallel = init_distributed(rank, world_size, init_method, "cpu", timeout=TIMEOUT)
    try:
        while True:
            method, arg = conn.recv()
            if method == "exit":
                return
            if method == "load":
                anyio.run(_serve, arg, parallel, conn)
            else:
                conn.send(RankError(f"no agent loaded for {method!r}"))
    finally:
        destroy_distributed()
    conn.close()
    os._exit(0)  # skip the interpreter's slow teardown (seconds on a busy machine)


async def _serve(load: Any, parallel: Any, conn: Connection) -> None:
    """Run one agent until ``unload``; answers every call on ``conn``."""
    from tgengine._faults import FaultInjector
    from tgengine.model_agent import ModelAgent

    config, cache_not_ready = load
    faults = FaultInjector(cache_not_ready_at=cache_not_ready) if cache_not_ready else None
    agent = ModelAgent(config, faults, parallel)
    async with anyio.create_task_group() as tg:
        try:
            info = await tg.start(agent.run)
        except Exception as exc:
            conn.send(_rank_error(exc))
            return
        conn.send(info)
        while True:
            method, arg = await anyio.to_thread.run_sync(conn.recv)
            if method == "unload":
                tg.cancel_scope.cancel()
                conn.send(None)
                return
            try:
                if method == "memory_stats":
                    answer: Any = agent.memory_stats()
                elif method == "parallel":
                    answer = agent.parallel
                elif method == "agree_any":
                    answer = agent.parallel.agree_any(arg)
                else:
                    answer = await getattr(agent, method)(arg)
            except Exception as exc:
                answer = _rank_error(exc)
            conn.send(answer)


def _rank_error(exc: BaseException) -> RankError:
    text = "".join(traceback.format_exception(exc))
    return RankError(f"{type(exc).__name__}: {exc}\n{text}")
