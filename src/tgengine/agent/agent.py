"""``ModelAgent``: owns the weights and the KV cache; runs forward steps off the event loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from .. import kernels
from ..config import EngineConfig
from ..core.step import SeqStep, StepBatch, StepResult
from ..errors import CacheNotReadyError, ModelLoadError
from ..models import (
    CausalLM,
    KVCache,
    ModelConfig,
    iter_stored,
    load_model,
    load_model_config,
    load_weights,
    resolve_dtype,
    weight_specs,
)
from ..models.gemm import can_pack_panels, release_scratch
from ..models.weights import copy_weights, drop_packed, pack_weights, resident_bytes
from ..runtime.parallel import ParallelContext, local_cuda
from ..sample.logits_processors import default_processors
from ..sample.sampler import Sampler
from ..sample.step_sampler import sample_step
from .compute_thread import ComputeThread
from .cpu_threads import available_cores, default_thread_count
from .host_memory import free_device_memory, process_rss
from .inputs import prepare_inputs
from .packed_parts import PanelGroup, PendingPanels, apply_pending, dense_named, merge_groups
from .staged_weights import apply_staged, merge_staged, rebuild_from_staged
from .weight_checks import check_named

log = logging.getLogger(__name__)
T = TypeVar("T")

CPU_KV_CACHE_BYTES = 512 * 1024**2  # default KV budget on CPU, where free memory means little
CLEANUP_TIMEOUT = 10.0


@dataclass(frozen=True)
class AgentInfo:
    """What the agent tells its parents once it can serve."""

    model_config: ModelConfig
    device: str
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    # {checkpoint name: (full shape, dtype)}: what a weight update may push
    weight_specs: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes held on one device; ``host_weights_bytes`` are weights offloaded by sleep(1).

    ``rss_bytes`` and ``peak_rss_bytes`` are the whole process's resident memory now and at
    its highest so far (host memory: on CPU, weights + KV cache + the runtime's overhead).
    """

    device: str
    weights_bytes: int
    kv_cache_bytes: int
    host_weights_bytes: int
    allocator: dict[str, int]
    rss_bytes: int = 0
    peak_rss_bytes: int = 0


class ModelAgent:
    """Holds the model and its KV cache for as long as ``run()`` runs.

    Every torch call runs in a worker thread, one at a time, so the event loop stays
    responsive during a step. The residency invariant — no forward step unless the
    weights and the KV cache are resident — is checked in one place, ``_forward``.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        parallel: ParallelContext | None = None,
        model_config: ModelConfig | None = None,
    ) -> None:
        self.config = config
        # Read once by the caller, when it has it (a worker process gets it from its parent:
        # reading config.json goes through transformers, seconds of imports).
        self._model_config = model_config
        self.parallel = parallel or ParallelContext()
        self._model: CausalLM | None = None
        self._kv: KVCache | None = None
        self._host_weights: dict[str, torch.Tensor] | None = None
        self._weights_resident = False
        self._staged: dict[str, torch.Tensor] = {}  # committed while asleep (staged_weights)
        self._pending = PendingPanels()  # the open update's parts, packed (level 2 asleep)
        self._staged_panels: dict[int, PanelGroup] = {}  # committed packed parts (level 2)
        self._specs: dict[str, tuple[torch.Size, torch.dtype]] = {}  # full (checkpoint) shapes
        self._local_shapes: dict[str, torch.Size] = {}  # this rank's shards
        self._info: AgentInfo | None = None
        self._prepared: tuple[ModelConfig, torch.dtype, torch.device] | None = None
        self._sampler = Sampler(seed=config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._compute = ComputeThread()  # every call's torch work, on one OS thread

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[AgentInfo] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Load weights and allocate the KV cache, then hold them; returns only when cancelled.

        On the way out (cancelled or failed) the memory is released under a shielded
        scope with a deadline, once any in-flight step has returned, or after
        ``step_timeout`` if it is wedged: its thread then frees what it holds when it returns.
        """
        try:
            info = await self._in_thread(self._load)
            task_status.started(info)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + CLEANUP_TIMEOUT
                # A step still in flight finishes first, unless it is wedged (step_timeout).
                wait = min(self.config.step_timeout or CLEANUP_TIMEOUT, CLEANUP_TIMEOUT)
                idle = await anyio.to_thread.run_sync(self._idle.wait, wait)
                # Idle: on the compute thread, after any call queued there. Wedged: beside
                # it; dropping our references is safe then: the step keeps its own, and what
                # they hold is freed when it returns.
                try:
                    if idle and not self._compute.closed:
                        await self._compute.run(self._release_all, abandon=True)
                    else:
                        await anyio.to_thread.run_sync(self._release_all)
                except Exception:  # never hide the error that brought us here
                    log.exception("releasing model memory failed")
                finally:
                    # Idle: the compute thread ends at once (wait for it); wedged: let it be.
                    await anyio.to_thread.run_sync(
                        self._compute.close, CLEANUP_TIMEOUT if idle else 0.0
                    )

    async def execute(self, batch: StepBatch) -> StepResult:
        """Run one forward step and sample.

        Cancelling abandons the worker thread, which finishes the step on its own.
        """
        return await self._in_thread(self._step, batch, abandon=True)

    async def sleep(self, level: int) -> None:
        await self._in_thread(self._sleep, level)

    async def wakeup(self, tag: str) -> bool:
        """Make ``tag`` resident again; True when the weights were reloaded from disk."""
        return await self._in_thread(self._wakeup, tag)

    async def check_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ``InvalidRequestError`` unless ``named`` fits: names, full shapes, dtypes.

        Changes nothing. With tensor parallelism the executor checks every rank first and
        calls ``update_weights`` only once all of them passed.
        """
        await self._in_thread(self._check_weights, named)

    async def update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Check ``named`` (full tensors), then copy them in (this rank's shard of each)."""
        await self._in_thread(self._update_weights, named)

    async def stage_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Keep checked tensors for the next ``wakeup("weights")`` (weights asleep only)."""
        if self._weights_resident:
            raise RuntimeError("stage_weights while the weights are resident")
        merge_staged(self._staged, named)

    async def absorb_part(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        """Pack the open update's checked tensors into new weights now, where the weights
        sleep at level 2 and the weight is pair panels (``packed_parts``); the names taken
        (none otherwise). ``InvalidRequestError`` for a tensor not finite."""
        return await self._in_thread(self._absorb, named)

    async def settle_absorbed(self, names: list[str]) -> None:
        """Commit what ``absorb_part`` took of ``names`` (nothing else of it applies)."""
        await self._in_thread(self._settle, names)

    async def drop_absorbed(self) -> None:
        """The open update ended without a commit: forget what was absorbed (on the
        compute thread, after any absorb still running there; at once once it is gone)."""
        if self._compute.closed:
            self._pending.clear()
            return
        await self._in_thread(self._pending.clear)

    def memory_stats(self) -> dict[str, MemoryStats]:
        device = self._info.device if self._info else "cpu"
        weights = 0
        if self._model is not None and self._weights_resident:
            weights = resident_bytes(self._model)
        host = 0
        if self._model is not None and self._host_weights is not None:
            # sleep(1) keeps the packed weights where they are: in host memory.
            host = _storage_bytes(self._host_weights.values()) + self._model.gemm.packed_bytes
        allocator: dict[str, int] = {}
        if device.startswith("cuda"):
            allocator = {
                "allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device),
            }
        kv = self._kv.nbytes if self._kv is not None else 0
        rss, peak = process_rss()
        return {device: MemoryStats(device, weights, kv, host, allocator, rss, peak)}

    # -- worker-thread side ---------------------------------------------------------

    async def _in_thread(self, fn: Callable[..., T], *args: Any, abandon: bool = False) -> T:
        return await self._compute.run(fn, *args, abandon=abandon)

    def prepare(self) -> None:
        """Read the model's config and set torch's thread count (blocking; once).

        ``run`` does this first if nobody did. The engine calls it before anything else
        runs beside the agent: the thread count is measured (``cpu_threads``), and work on
        another core would bias the measurement towards one thread. Runs on the compute
        thread, where every forward runs (torch's thread count is a setting of that thread).
        """
        self._compute.call(self._prepare)

    def _prepare(self) -> None:
        if self._prepared is not None:
            return
        cfg = self.config
        model_config = self._model_config or load_model_config(cfg.model)
        dtype = resolve_dtype(cfg.dtype, model_config)
        device = _pick_device(cfg.device, self.parallel)
        if cfg.num_threads or device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or self._default_threads(dtype))
        if device.type == "cpu":
            kernels.load()  # built once per machine; at start-up, not in the first step
        if cfg.quantization is not None and not (device.type == "cpu" and can_pack_panels(dtype)):
            reason = (
                f"quantization={cfg.quantization!r} runs bfloat16/float16 models on a CPU with "
                f"AVX2 and tgengine's kernels (here: {dtype} on {device})"
            )
            raise ModelLoadError(cfg.model, reason)
        self._prepared = (model_config, dtype, device)

    def _load(self) -> AgentInfo:
        cfg = self.config
        self.prepare()
        assert self._prepared is not None
        model_config, dtype, device = self._prepared
        self._model = load_model(model_config, cfg.model, dtype, device, self.parallel)
        eos = frozenset(model_config.eos_token_ids)
        self._sampler = Sampler(seed=cfg.seed, processors=default_processors(eos))
        self._model.gemm.prepack = cfg.prepack_weights
        self._model.gemm.quantization = cfg.quantization
        pack_weights(self._model)
        self._weights_resident = True
        self._specs = weight_specs(self._model)
        self._local_shapes = {name: p.shape for name, p in self._model.named_parameters()}
        max_len = cfg.max_model_len or model_config.max_position_embeddings
        num_blocks = self._plan_num_blocks(model_config, dtype, device, max_len)
        self._kv = KVCache.allocate(
            model_config, num_blocks, cfg.block_size, dtype, device, self.parallel
        )
        self._info = AgentInfo(
            model_config=model_config,
            device=str(device),
            dtype=dtype,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_model_len=min(max_len, num_blocks * cfg.block_size),
            weight_specs=dict(self._specs),
        )
        return self._info

    def _default_threads(self, dtype: torch.dtype) -> int:
        if self.parallel.is_parallel:  # the ranks share this machine's cores
            return max(1, available_cores() // self.parallel.world_size)
        return default_thread_count(dtype)

    def _plan_num_blocks(
        self, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int
    ) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = KVCache.bytes_per_block(mc, cfg.block_size, dtype, self.parallel)
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        else:
            budget = CPU_KV_CACHE_BYTES
        blocks_per_seq = -(-max_len // cfg.block_size)
        num_blocks = min(budget // per_block, cfg.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            reason = f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)"
            raise ModelLoadError(cfg.model, reason)
        return int(num_blocks)

    @contextmanager
    def _stepping(self) -> Iterator[None]:
        """Marks a step in flight: the clean-up waits for it (up to ``step_timeout``)."""
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def _step(self, batch: StepBatch) -> StepResult:
        with self._stepping():
            for seq_id in batch.finished_ids:
                self._generators.pop(seq_id, None)
            result = StepResult()
            problems = [self._cache_problem(seq) for seq in batch.seqs]
            # Every rank runs the same forward: a problem on any rank is every rank's.
            agreed = self.parallel.agree_any([p is not None for p in problems])
            ready = []
            for seq, problem, bad in zip(batch.seqs, problems, agreed, strict=True):
                if not bad:
                    ready.append(seq)
                else:
                    problem = problem or "the KV cache is not ready on another rank"
                    result.errors[seq.seq_id] = str(CacheNotReadyError(seq.seq_id, problem))
            if ready:
                self._forward(ready, result)
            return result

    def _cache_problem(self, seq: SeqStep) -> str | None:
        """Why ``seq``'s KV cache cannot take this step, or None when it can."""
        if self._kv is None:
            return "the KV cache is released (the engine is asleep)"
        bs = self._kv.block_size
        last_pos = seq.start_pos + len(seq.token_ids) - 1
        first, num_blocks = seq.num_released_blocks, seq.num_released_blocks + len(seq.block_table)
        if last_pos // bs >= num_blocks or seq.start_pos // bs < first:
            return f"positions {seq.start_pos}..{last_pos} are not in blocks {first}..{num_blocks}"
        table, num_cache_blocks = seq.block_table, self._kv.num_blocks
        if table and (min(table) < 0 or max(table) >= num_cache_blocks):  # one pass each, in C
            block = next(b for b in table if not 0 <= b < num_cache_blocks)
            return f"block {block} is not in the cache ({num_cache_blocks} blocks)"
        return None

    def _forward(self, seqs: list[SeqStep], result: StepResult) -> None:
        if self._model is None or not self._weights_resident or self._kv is None:
            raise RuntimeError("invariant violated: forward step while memory is not resident")
        device = self._kv.kv.device
        with torch.inference_mode():
            inputs = prepare_inputs(seqs, self._kv.block_size, device)
            logits = self._model(inputs, self._kv)
            if self.parallel.is_driver:  # the other ranks' tokens would be ignored
                sample_step(logits, seqs, self._sampler, self._generator, result)

    def _generator(self, seq: SeqStep) -> torch.Generator | None:
        if seq.params is None or seq.params.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self._kv.kv.device if self._kv else "cpu")
            gen.manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def _sleep(self, level: int) -> None:
        self._kv = None
        model = self._model
        if model is not None and self._weights_resident:
            if level == 1:
                # Packed weights are host memory already and stay where they are.
                self._host_weights = {
                    name: p.detach().to("cpu", copy=p.device.type != "cpu")
                    for name, p in model.named_parameters()
                }
            for p in model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_resident = False
        if level == 2:
            self._host_weights = None
            if model is not None:
                drop_packed(model)
        release_scratch()  # this (the compute) thread's: every forward runs here
        free_device_memory()

    def _wakeup(self, tag: str) -> bool:
        if self._info is None or self._model is None:
            raise RuntimeError("wakeup before the model was loaded")
        if tag == "kv_cache":
            if self._kv is None:
                info = self._info
                self._kv = KVCache.allocate(
                    info.model_config,
                    info.num_blocks,
                    info.block_size,
                    info.dtype,
                    torch.device(info.device),
                    self.parallel,
                )
            return False
        if self._weights_resident:
            return False
        device = torch.device(self._info.device)
        reloaded = self._host_weights is None
        if reloaded and (self._staged or self._staged_panels):  # level 2, updated since
            reloaded = rebuild_from_staged(
                self._model,
                self._staged,
                self._staged_panels,
                self._local_shapes,
                device,
                self.config.model,
            )
            pack_weights(self._model)
        elif reloaded:
            for name, p in self._model.named_parameters():
                p.data = torch.empty(self._local_shapes[name], dtype=p.dtype, device=device)
            load_weights(self._model, iter_stored(self.config.model), strict=True)
            pack_weights(self._model)
        else:
            assert self._host_weights is not None
            for name, p in self._model.named_parameters():
                p.data = self._host_weights[name].to(device)
            apply_staged(self._model, self._staged)
        self._host_weights = None
        self._weights_resident = True
        return reloaded

    def _absorb(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        level_2 = not self._weights_resident and self._host_weights is None
        if self._model is None or not level_2:
            return []
        return self._pending.absorb(self._model, self._local_shapes, named)

    def _settle(self, names: list[str]) -> None:
        assert self._model is not None
        groups = self._pending.take(names, self._model)
        if self._weights_resident:
            apply_pending(self._model, groups)
        elif self._host_weights is None:
            merge_groups(self._staged_panels, groups)
        else:  # asleep at level 1 since: the plain path, at its wakeup
            merge_staged(self._staged, dense_named(self._model, groups))

    def _update_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Check every tensor, then copy them all (a trainer's ``state_dict()`` as it is).

        Names and shapes are strict. A tied model's ``lm_head.weight`` (the embedding under
        another name) is skipped; floating tensors of another dtype are cast.
        """
        named = self._check_weights(named)
        assert self._model is not None  # _check_weights raised otherwise
        copy_weights(self._model, named)  # copy_ casts to each parameter's dtype

    def _check_weights(
        self, named: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """``named`` without what is skipped, once every tensor passed the checks."""
        if self._model is None or not self._weights_resident:
            raise RuntimeError("update_weights while the weights are not resident")
        return check_named(self._specs, named)

    def _release_all(self) -> None:
        self._kv = None
        self._model = None
        self._host_weights = None
        self._weights_resident = False
        self._staged.clear()
        self._staged_panels.clear()
        self._pending.clear()
        self._generators.clear()
        free_device_memory()


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views and placeholders count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _pick_device(device: str, parallel: ParallelContext) -> torch.device:
    """The device asked for; with tensor parallelism a bare "cuda" is the rank's own GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    picked = torch.device(device)
    if picked.type == "cuda" and picked.index is None and parallel.is_parallel:
        return local_cuda(parallel.rank)
    return picked
