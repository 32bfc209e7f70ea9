"""``RayExecutor``: one Ray actor per tensor-parallel rank, placed with a placement group.

``run()`` joins Ray (``EngineConfig.ray_address``) or starts a local one, places one
bundle per rank (``ray_placement_strategy``: one node or several), starts a ``RankActor``
actor in each, and calls ``started()`` once every rank has loaded its shard and allocated
its KV cache. While it runs, one task per rank awaits that rank's ``serve()``: an actor or
node that is lost, or an agent that fails, ends ``run()`` at once with ``WorkerExited`` or
``WorkerFailed`` naming the rank. On the way out (stopped, cancelled or failed) every
actor is killed, the placement group removed, and a Ray this executor started shut down.

Every Ray call blocks, so each runs in a worker thread (``anyio.to_thread``): the event
loop stays free under asyncio and trio alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import torch

from ..agent.agent import AgentInfo, MemoryStats, ModelAgent
from ..config import EngineConfig
from ..core.step import StepBatch, StepResult
from ..errors import WorkerError, WorkerExited, WorkerFailed
from ..models import load_model_config
from . import ray_cluster
from .base import AgentFactory
from .ray_actor import ACTOR_OPTIONS, RankActor
from .worker import Execute, RankSpec, Sleep, Wakeup

T = TypeVar("T")
RELEASE_TIMEOUT = 30.0  # seconds for the actors to die and Ray's calls to return
FAULT_GRACE = 0.5  # seconds for a lost rank's own error to arrive before a peer's


class RayExecutor:
    """Runs ``tensor_parallel_size`` ``RankActor`` actors; rank 0's tokens are the step's."""

    def __init__(self, config: EngineConfig, *, agent_factory: AgentFactory = ModelAgent) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.agent_factory = agent_factory
        self.actors: list[Any] = []  # ray.actor.ActorHandle per rank
        self.node_ids: list[str] = []  # the Ray node of each rank
        self.pids: list[int] = []  # the process of each rank's actor
        self._serving: list[Any] = []  # each rank's serve() ObjectRef
        self._bundle: dict[str, float] = {}
        self._memory: dict[str, MemoryStats] = {}
        self._closing = threading.Event()
        self._in_flight = 0
        self._settled = threading.Condition()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the ranks; ``started(info)`` once all can serve; returns only when cancelled."""
        owns_ray = False
        group: Any = None
        try:
            # Setting up is not abandoned when cancelled: what it makes, the release undoes.
            owns_ray = await anyio.to_thread.run_sync(
                ray_cluster.connect, self.config.ray_address, self.world_size
            )
            group = await anyio.to_thread.run_sync(self._place)
            async with anyio.create_task_group() as tg:
                await anyio.to_thread.run_sync(self._start_actors, group)
                for rank in range(self.world_size):
                    tg.start_soon(self._watch, rank)
                infos = await self._gather("ready")
                await self._refresh_memory_stats()
                task_status.started(_merge_infos(infos))
        finally:
            self._closing.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._release, group, owns_ray)

    # -- the Executor protocol -------------------------------------------------------

    async def execute(self, batch: StepBatch) -> StepResult:
        results = await self._gather("handle", Execute(batch), step=True)
        result: StepResult = results[0]
        return result

    async def sleep(self, level: int) -> None:
        await self._gather("handle", Sleep(level))
        await self._refresh_memory_stats()

    async def wakeup(self, tag: str) -> bool:
        reloaded = await self._gather("handle", Wakeup(tag))
        await self._refresh_memory_stats()
        return any(reloaded)

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every rank checks the full tensors; only once all passed does any rank apply.

        The tensors go into Ray's object store once; every rank reads them from there.
        """
        ref = await self._blocking(_put, named)
        await self._gather("handle_weights", False, ref)
        await self._gather("handle_weights", True, ref)
        await self._refresh_memory_stats()

    def prepare(self) -> None:
        """Nothing: each rank measures nothing (it takes its share of the cores)."""

    def memory_stats(self) -> dict[str, MemoryStats]:
        """One entry per rank (``rank{r}:{device}``), as of the start or the last control call."""
        return dict(self._memory)

    # -- liveness ----------------------------------------------------------------------

    async def _watch(self, rank: int) -> None:
        """Raise, naming ``rank``, as soon as its actor is lost or its agent fails."""
        try:
            await self._blocking(_wait_ref, self._serving[rank])
        except Exception as exc:
            if not self._closing.is_set():
                error = self._rank_error(rank, exc)
                raise error from error.__cause__
            return
        if not self._closing.is_set():
            raise WorkerExited(rank, self._pid(rank), None, "stopped serving without an error")

    # -- Ray calls (each blocking call in a worker thread) ------------------------------

    async def _gather(self, method: str, *args: Any, step: bool = False) -> list[Any]:
        """``method`` on every rank at once; their results by rank.

        The first rank to fail raises: a lost rank as ``WorkerExited``; a step that raised
        as ``WorkerFailed``; another call's error as itself (``InvalidRequestError`` from a
        weight check is the caller's).
        """
        return await self._blocking(self._call_all, method, args, step)

    def _call_all(self, method: str, args: tuple[Any, ...], step: bool) -> list[Any]:
        import ray

        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:
                error = self._blame(refs.index(done[0]), exc, step)
                raise error from error.__cause__
        return list(ray.get(refs))

    def _blame(self, rank: int, exc: Exception, step: bool) -> BaseException:
        """What to raise when ``rank``'s call failed with ``exc``.

        A lost rank is the cause of everything after it: its peers fail too once their
        collective breaks, so a lost rank's ``serve()`` gets a moment to say so first.
        """
        if not step and not _is_lost(exc):
            cause = _task_cause(exc)
            cause.add_note(f"(in the rank {rank} Ray actor)")
            return cause
        if not _is_lost(exc):
            lost = self._lost_rank(FAULT_GRACE)
            if lost is not None:
                return lost
        return self._rank_error(rank, exc)

    def _lost_rank(self, timeout: float) -> WorkerError | None:
        import ray

        done, _ = ray.wait(self._serving, num_returns=1, timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:
                if _is_lost(exc):
                    return self._rank_error(self._serving.index(ref), exc)
        return None

    def _rank_error(self, rank: int, exc: Exception) -> WorkerError:
        if _is_lost(exc):
            reason = f"lost: {type(exc).__name__}: {_why_lost(exc)}"
            error: WorkerError = WorkerExited(rank, self._pid(rank), None, reason)
            error.__cause__ = exc
            return error
        return WorkerFailed(rank, _task_cause(exc))

    def _pid(self, rank: int) -> int | None:
        return self.pids[rank] if rank < len(self.pids) else None

    def _place(self) -> Any:
        use_gpus = ray_cluster.wants_gpus(self.config.device, self.world_size)
        group, self._bundle = ray_cluster.place(
            self.world_size, self.config.ray_placement_strategy, use_gpus
        )
        return group

    def _start_actors(self, group: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            options = {
                **ACTOR_OPTIONS,
                "num_cpus": self._bundle["CPU"],
                "num_gpus": self._bundle.get("GPU", 0.0),
                "scheduling_strategy": strategy,
            }
            self.actors.append(remote.options(**options).remote())
        where = ray.get([actor.whereabouts.remote() for actor in self.actors])
        self.node_ids = [node for node, _, _ in where]
        self.pids = [pid for _, _, pid in where]
        init_method = None
        if self.world_size > 1:  # rank 0's node hosts the rendezvous
            port = ray.get(self.actors[0].free_port.remote())
            init_method = f"tcp://{where[0][1]}:{port}"
        # Read here (the engine has transformers imported): the ranks skip its imports.
        model_config = load_model_config(self.config.model)
        self._serving = [
            actor.serve.remote(
                RankSpec(
                    self.config,
                    rank,
                    self.world_size,
                    init_method,
                    model_config,
                    self.agent_factory,
                )
            )
            for rank, actor in enumerate(self.actors)
        ]

    async def _refresh_memory_stats(self) -> None:
        merged: dict[str, MemoryStats] = {}
        for stats in await self._gather("memory_stats"):
            merged.update(stats)  # keyed rank{r}:{device} by each rank (device alone at 1)
        self._memory = merged

    def _release(self, group: Any, owns_ray: bool) -> None:
        """Kill every actor, wait for the calls still out, drop the group, stop our Ray."""
        try:
            if self.actors:
                ray_cluster.kill(self.actors, self._serving, RELEASE_TIMEOUT)
            with self._settled:
                self._settled.wait_for(lambda: self._in_flight == 0, RELEASE_TIMEOUT)
            if group is not None:
                ray_cluster.remove_group(group)
        finally:
            if owns_ray:
                ray_cluster.shutdown()

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread that cancelling abandons.

        An abandoned call counts as in flight until it returns: ``_release`` kills the
        actors (which ends it) and waits for it before shutting Ray down under its feet.
        """
        with self._settled:
            self._in_flight += 1
        return await anyio.to_thread.run_sync(self._counted, fn, *args, abandon_on_cancel=True)

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            with self._settled:
                self._in_flight -= 1
                self._settled.notify_all()


def _merge_infos(infos: list[AgentInfo]) -> AgentInfo:
    """Rank 0's info within every rank's limits (the KV cache the scheduler may use)."""
    import dataclasses

    return dataclasses.replace(
        infos[0],
        num_blocks=min(info.num_blocks for info in infos),
        max_model_len=min(info.max_model_len for info in infos),
    )


def _put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _wait_ref(ref: Any) -> Any:
    import ray

    return ray.get(ref)


def _is_lost(exc: BaseException) -> bool:
    """The rank's actor, process or node is gone (rather than its code raising)."""
    from ray import exceptions as rx

    lost = (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.LocalRayletDiedError)
    return isinstance(exc, lost)


def _why_lost(exc: BaseException) -> str:
    """Ray's message in a line: its first line and the one that says why (a node death)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = [line for line in lines[1:] if "because" in line or "node" in line.lower()]
    return " ".join(lines[:1] + why[:1])


def _task_cause(exc: BaseException) -> BaseException:
    """The exception a rank's method raised, without Ray's wrapper."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
        return exc.cause
    return exc
