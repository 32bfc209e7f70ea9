"""One tensor-parallel group of spawned ranks that serves one model after another.

An ``Engine`` with ``executor="mp"`` starts its worker processes for one model; the
per-architecture tests would pay that start (seconds of imports per process) once per
model. Here N processes are spawned once, and each ``load(config)`` runs the executors'
own ``RankWorker`` (``executor.worker``: rendezvous, ``ModelAgent`` of that rank, command
handling) on every one of them; ``call(command)`` sends the same worker command to every
rank and returns each rank's answer. Plain synchronous calls over pipes, every wait bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from fault_injection import FaultPlan

TIMEOUT = 60.0


class RankError(Exception):
    """A rank raised: its exception's type and message, and its traceback."""


class RankGroup:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        from fault_injection import new_plan_file

        self.world_size = world_size
        self.plan_file = new_plan_file()
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def load(self, config: Any) -> list[Any]:
        """Start every rank on ``config`` (a fresh rendezvous); each rank's ``AgentInfo``.

        Every rank's agent follows the fault plan that ``call`` is given (see
        ``fault_injection``)."""
        from tgengine.executor.worker import RankSpec
        from tgengine.runtime.parallel import free_port

        from fault_injection import PlannedAgents

        init_method = f"tcp://127.0.0.1:{free_port()}"
        n = self.world_size
        agents = PlannedAgents(self.plan_file)
        specs = [RankSpec(config, r, n, init_method, agent_factory=agents) for r in range(n)]
        return self._all(specs)

    def call(
        self, command: Any, *, raise_errors: bool = True, faults: FaultPlan | None = None
    ) -> list[Any]:
        """``RankWorker.handle(command)`` on every rank; each rank's answer (or RankError).

        ``faults``: the plan the ranks follow in this call (a step of it is step 1)."""
        from fault_injection import remove_plan, write_plan

        if faults is not None:
            write_plan(self.plan_file, faults, 0)
        try:
            return self._all([command] * self.world_size, raise_errors)
        finally:
            remove_plan(self.plan_file)

    def unload(self) -> None:
        self._all([None] * self.world_size)

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)

    def _all(self, messages: list[Any], raise_errors: bool = True) -> list[Any]:
        for conn, message in zip(self.conns, messages, strict=True):
            conn.send(message)
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(TIMEOUT):
                raise TimeoutError(f"rank {rank} did not answer in {TIMEOUT} s")
            answers.append(conn.recv())
        failed = [a for a in answers if isinstance(a, RankError)]
        if failed and raise_errors:
            raise failed[0]
        return answers


def _rank_main(conn: Connection) -> None:
    """Serve one ``RankSpec`` after another until told to exit (None)."""
    while (spec := conn.recv()) is not None:
        anyio.run(_serve, spec, conn)
    conn.close()
    os._exit(0)  # skip the interpreter's teardown (seconds on a busy machine)


async def _serve(spec: Any, conn: Connection) -> None:
    """Run one rank until None comes; answers every command on ``conn``."""
    from tgengine.executor.worker import RankWorker

    worker = RankWorker(spec)
    async with anyio.create_task_group() as tg:
        try:
            info = await tg.start(worker.run)
        except Exception as exc:
            conn.send(_rank_error(exc))
            return
        conn.send(info)
        while (command := await anyio.to_thread.run_sync(conn.recv)) is not None:
            try:
                answer = await worker.handle(command)
            except Exception as exc:
                answer = _rank_error(exc)
            conn.send(answer)
        tg.cancel_scope.cancel()
    conn.send(None)


def _rank_error(exc: BaseException) -> RankError:
    text = "".join(traceback.format_exception(exc))
    return RankError(f"{type(exc).__name__}: {exc}\n{text}")
