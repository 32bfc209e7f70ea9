"""``MPExecutor``: one worker process per tensor-parallel rank, on this machine.

Each worker (``mp_worker``) runs one rank's ``ModelAgent`` under the agent's own
``run()``. A step is pickled once and the same bytes go to every rank over its socket;
rank 0's reply carries the sampled tokens. Weights for ``update_weights`` travel as one
safetensors file in ``/dev/shm``, which each rank maps and copies only its shard from.
An update committed while the weights sleep stays in its file until ``wakeup("weights")``,
where every rank builds its weights from those files, in commit order, as an agent does
from weights staged in its own process (``ModelAgent.stage_weights``): from host memory
or, at level 2, from the files alone, reading from the model directory only the tensors
they do not hold (and only then is it a reload: a new ``weight_version``).
A rank that dies, or raises, is a fault: the pending call fails at once with a
``WorkerError`` that names the rank (the engine dies of it), and ``run()`` raises it when
no call was pending.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats, ModelAgent
from ..config import EngineConfig
from ..core.step import StepBatch, StepResult
from ..errors import WorkerError, WorkerExited, WorkerFailed
from ..ipc.calls import CallTracker, Reply
from ..ipc.spawn import spawn_child
from ..ipc.weights_file import remove_weights_dir, write_weights_dir
from ..ipc.wire import Channel, encode
from ..models import load_model_config
from ..runtime.parallel import free_port
from .base import AgentFactory
from .mp_messages import Fatal, Loaded, Memory
from .mp_timings import StepTimings
from .worker import CheckWeights, Command, Execute, RankSpec, Sleep, UpdateWeights, Wakeup

WORKER_MODULE = "tgengine.executor.mp_worker"
EXIT_STATUS_WAIT = 0.5  # seconds to wait for a dead worker's exit status
SETTLE_TIMEOUT = 1.0  # seconds the other ranks get to answer (or die) after one failed
FAULT_SHUTDOWN = 1.0  # seconds workers get to exit after a fault or an abandoned step


@dataclasses.dataclass
class _Rank:
    rank: int
    process: anyio.abc.Process
    channel: Channel
    loaded: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    info: AgentInfo | None = None


class MPExecutor:
    """Runs ``config.tensor_parallel_size`` ranks, each in its own worker process.

    ``run()`` starts the workers, calls ``started(info)`` once every rank has loaded its
    shard and allocated its KV cache (``num_blocks``: the minimum over ranks), and returns
    only when cancelled, after every worker has exited (killed after ``shutdown_timeout``
    seconds, or one second after a fault). It raises ``WorkerExited`` or ``WorkerFailed``
    when a rank dies or fails while no call is pending.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        shutdown_timeout: float = 10.0,
        agent_factory: AgentFactory = ModelAgent,
    ) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.shutdown_timeout = shutdown_timeout
        self.agent_factory = agent_factory
        self._ranks: list[_Rank] = []
        self._calls = CallTracker()
        self._send_lock = anyio.Lock()
        self._memory: dict[int, dict[str, MemoryStats]] = {}
        self._fault: BaseException | None = None
        self._abandoned = False
        self._staged: list[Path] = []  # updates committed asleep, for the next weights wakeup
        self.timings = StepTimings()

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, by rank (for tests and tools)."""
        return [r.process.pid for r in self._ranks]

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the workers; ``started(info)`` once all serve; returns only when cancelled."""
        n = self.world_size
        init_method = f"tcp://127.0.0.1:{free_port()}" if n > 1 else None
        try:
            async with anyio.create_task_group() as tg:
                for rank in range(n):
                    process, channel = await spawn_child(WORKER_MODULE)
                    self._ranks.append(_Rank(rank, process, channel))
                # While the workers import torch; this process has transformers already.
                model_config = await anyio.to_thread.run_sync(load_model_config, self.config.model)
                for r in self._ranks:
                    spec = RankSpec(
                        self.config, r.rank, n, init_method, model_config, self.agent_factory
                    )
                    await r.channel.send(spec)
                    tg.start_soon(self._read, r)
                for r in self._ranks:
                    await r.loaded.wait()
                task_status.started(self._merged_info())
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap()
            for path in self._staged:
                remove_weights_dir(path)
            self._staged = []
            self._memory = {rank: _released(m) for rank, m in self._memory.items()}

    def _merged_info(self) -> AgentInfo:
        infos = [r.info for r in self._ranks if r.info is not None]
        first = infos[0]
        return dataclasses.replace(
            first,
            num_blocks=min(i.num_blocks for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
        )

    async def _read(self, r: _Rank) -> None:
        """Dispatch rank ``r``'s messages; raises once it is gone (or failed)."""
        try:
            while True:
                match await r.channel.receive():
                    case Reply() as reply:
                        self._answer(r.rank, reply)
                    case Memory(stats):
                        self._memory[r.rank] = stats
                    case Loaded(info, _, memory):
                        r.info = info
                        self._memory[r.rank] = memory
                        r.loaded.set()
                    case Fatal(error):
                        if not r.loaded.is_set():  # failed loading: the error as it is
                            error.add_note(f"(in the rank {r.rank} worker)")
                            raise error
                        failed = WorkerFailed(r.rank, error)
                        if self._lose(failed):
                            return  # the pending step raises it: the engine dies of it at once
                        raise failed
        except anyio.EndOfStream:
            with anyio.move_on_after(EXIT_STATUS_WAIT):
                await r.process.wait()
            lost = WorkerExited(r.rank, r.process.pid, r.process.returncode)
            if self._lose(lost):
                return
            raise lost from None

    def _answer(self, rank: int, reply: Reply) -> None:
        call = self._calls.get(reply.call_id)
        if call is not None and reply.error is not None and isinstance(call.command, Execute):
            reply = dataclasses.replace(reply, error=WorkerFailed(rank, reply.error))
        self._calls.reply(reply, rank)

    def _lose(self, lost: WorkerError) -> bool:
        """Fail every pending call with ``lost``; True when a step was among them."""
        self._fault = self._fault or lost
        had_step = any(isinstance(call.command, Execute) for call in self._calls)
        self._calls.fail_all(lost.rank, lambda: lost, lost=isinstance(lost, WorkerExited))
        return had_step

    async def _reap(self) -> None:
        """Close every channel (a worker stops at end of stream), wait, kill what is left."""
        for r in self._ranks:
            await r.channel.aclose()
        faulty = self._fault is not None or self._abandoned
        with anyio.move_on_after(FAULT_SHUTDOWN if faulty else self.shutdown_timeout):
            for r in self._ranks:
                await r.process.wait()
        for r in self._ranks:
            if r.process.returncode is None:
                r.process.kill()
            await r.process.wait()
            await r.process.aclose()

    # -- the Executor calls -----------------------------------------------------------

    async def execute(self, batch: StepBatch) -> StepResult:
        results = await self._broadcast(Execute(batch))
        result: StepResult = results[0]
        return result

    async def sleep(self, level: int) -> None:
        await self._broadcast(Sleep(level))

    async def wakeup(self, tag: str) -> bool:
        """True when any weight was read from the model directory: none is when the
        updates staged while the weights slept hold them all (as ``UniExecutor``'s)."""
        staged = list(self._staged) if tag == "weights" else []
        reloaded = any(await self._broadcast(Wakeup(tag, tuple(map(str, staged)))))
        for path in staged:  # each rank holds what it took of them: the files can go
            remove_weights_dir(path)
        del self._staged[: len(staged)]
        return reloaded

    async def stage_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Keep checked tensors (the engine checked them) for the next ``wakeup("weights")``:
        written to ``/dev/shm`` now; the ranks take them at that wakeup."""
        self._staged.append(await anyio.to_thread.run_sync(write_weights_dir, named))

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every rank checks the full tensors; only if all pass does any rank apply them."""
        path = await anyio.to_thread.run_sync(write_weights_dir, named)
        try:
            await self._broadcast(CheckWeights(str(path)))
            await self._broadcast(UpdateWeights(str(path)))
        finally:
            remove_weights_dir(path)

    def prepare(self) -> None:
        """Nothing: each rank measures nothing (it takes its share of the cores)."""

    def memory_stats(self) -> dict[str, MemoryStats]:
        """Every rank's figures (as of its latest reply), one entry per rank."""
        merged: dict[str, MemoryStats] = {}
        for rank in sorted(self._memory):
            merged.update(self._memory[rank])
        return merged

    async def _broadcast(self, command: Command) -> list[Any]:
        """Send ``command`` to every rank (one pickle); their results by rank."""
        if self._fault is not None:
            raise self._fault
        is_step = isinstance(command, Execute)
        start = time.perf_counter()
        with self._calls.open(command, len(self._ranks)) as (request, call):
            try:
                frame = encode(request)
                async with self._send_lock:
                    for r in self._ranks:
                        try:
                            await r.channel.send_encoded(frame)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                            pass  # that worker is gone: its reader fails this call
                await call.done.wait()
                if call.errors:
                    with anyio.move_on_after(SETTLE_TIMEOUT):
                        await call.settled.wait()
            except BaseException:
                if not call.settled.is_set():
                    self._abandoned = True  # a rank may still be in it: do not wait long
                raise
        if call.error is not None:
            if is_step:  # the engine dies of it: the other ranks may be stuck
                self._fault = self._fault or call.error
            raise call.error
        if is_step:
            self.timings.add(time.perf_counter() - start, call.elapsed)
        return call.results_by_peer()


def _released(memory: dict[str, MemoryStats]) -> dict[str, MemoryStats]:
    """A rank's figures once its worker is gone: it holds nothing (as ``UniExecutor``'s
    after its agent released its memory)."""
    return {
        key: dataclasses.replace(m, weights_bytes=0, kv_cache_bytes=0, host_weights_bytes=0)
        for key, m in memory.items()
    }
