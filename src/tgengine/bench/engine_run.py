"""Driving tgengine through its public API for the benches, and timing what it does."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..engine.engine import Engine
from ..models.step_timers import ForwardTimes
from ..sampling import SamplingParams
from .common import BenchSetup
from .workload import BenchRequest


def engine_config(setup: BenchSetup, dtype: str | None = None) -> EngineConfig:
    """The engine configuration every tgengine run of a bench uses (``dtype`` overrides)."""
    return EngineConfig(
        model=setup.model_dir,
        dtype=dtype or setup.dtype,
        device=setup.device,
        num_threads=setup.threads if setup.device.startswith("cpu") else None,
        kv_cache_memory=setup.kv_cache_memory,
        tensor_parallel_size=setup.tensor_parallel_size,
        executor=setup.executor,  # type: ignore[arg-type]
        ray_address=setup.ray_address,
        quantization=setup.quantization,  # type: ignore[arg-type]
        prepack_weights=setup.prepack_weights,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class StreamTiming:
    """One request as its consumer saw it: when it was submitted and when each token came."""

    submitted: float
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def inter_token(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


async def stream_one(
    engine: Engine, request: BenchRequest, on_token: Callable[[int], None] | None = None
) -> StreamTiming:
    timing = StreamTiming(time.perf_counter())
    async for chunk in engine.generate(request.prompt, greedy(request.max_tokens)):
        if chunk.token_ids:
            now = time.perf_counter()
            timing.token_times.extend([now] * len(chunk.token_ids))
            if on_token is not None:
                on_token(len(chunk.token_ids))
        timing.finish_reason = chunk.finish_reason
    return timing


async def run_all(
    engine: Engine, requests: list[BenchRequest], *, desc: str = "tgengine", progress: bool = True
) -> tuple[float, list[StreamTiming]]:
    """Submit every request at once; the wall time until the last finished, and each timing."""
    timings: list[StreamTiming | None] = [None] * len(requests)
    total = sum(r.max_tokens for r in requests)
    bar = tqdm(total=total, desc=desc, unit="tok", disable=not progress, leave=False)

    async def one(i: int) -> None:
        timings[i] = await stream_one(engine, requests[i], bar.update)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    bar.close()
    return wall, [t for t in timings if t is not None]


async def warm_up(engine: Engine) -> None:
    """A few short requests, so that one-time costs (first allocations) are not timed."""
    await stream_one(engine, BenchRequest(list(range(16, 48)), 4))
    await run_all(
        engine, [BenchRequest(list(range(16, 16 + n)), 3) for n in (8, 24)], progress=False
    )


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in points} | {"mean": 0.0}
    ordered = sorted(values)
    result = {}
    for p in points:
        index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        result[f"p{p}"] = ordered[index]
    result["mean"] = statistics.fmean(ordered)
    return result


# -- where a step's time goes ----------------------------------------------------------


@dataclass(frozen=True)
class ForwardParts:
    """One forward's time in products and attention (``models.step_timers``) and its size."""

    products_s: float
    attention_s: float
    logits_rows: int
    kv_tokens: int  # context tokens whose keys and values the step's attention reads


@dataclass
class StepProfiler:
    """Intervals of named functions, recorded while ``profile_steps`` is active."""

    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # (start, end, rows, decode rows) of each forward
    forwards: list[tuple[float, float, int, int]] = field(default_factory=list)
    # With ``profile_steps(split=True)``, one per forward: its ``ForwardParts``.
    parts: list[ForwardParts] = field(default_factory=list)

    def record(self, name: str, start: float, end: float) -> None:
        self.intervals.setdefault(name, []).append((start, end))

    def steady_state(self, num_decode_rows: int) -> dict[str, Any]:
        """Per-step breakdown over consecutive forwards of exactly ``num_decode_rows`` decodes.

        A step's period runs from one forward's start to the next one's; what is not inside
        the forward is the engine's own time (scheduling, inputs, sampling, detokenizing,
        event loop and thread hops).
        """
        steps = [
            (start, following[0], end - start)
            for (start, end, rows, decode), following in itertools.pairwise(self.forwards)
            if rows == decode == num_decode_rows
        ]
        if not steps:
            return {"num_steps": 0}
        period = sum(b - a for a, b, _ in steps)
        forward = sum(d for _, _, d in steps)
        parts = {}
        for name, spans in self.intervals.items():
            inside = 0.0
            for a, b, _ in steps:
                inside += sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)
            parts[f"{name}_ms"] = 1e3 * inside / len(steps)
        return {
            "num_steps": len(steps),
            "num_decode_rows": num_decode_rows,
            "step_ms": 1e3 * period / len(steps),
            "forward_ms": 1e3 * forward / len(steps),
            "outside_forward_ms": 1e3 * (period - forward) / len(steps),
            "fraction_outside_forward": (period - forward) / period if period > 0 else 0.0,
            **parts,
        }

    def forward_split(self) -> dict[str, float]:
        """Shares of the forwards' time in attention, MoE routing and the experts; {} if no MoE.

        ``experts`` is the MoE blocks' time less their routing (grouping the rows by expert
        included); ``rest`` is everything else in the forward (embedding, norms, dense MLPs,
        the LM head). Meaningful on CPU only: on an accelerator the layers' times are launches.
        """
        forward = sum(end - start for start, end, _, _ in self.forwards)
        if forward <= 0 or "moe" not in self.intervals:
            return {}
        spent = {n: sum(e - s for s, e in self.intervals.get(n, [])) for n in _SPLIT_PARTS}
        split = {
            "attention": spent["attention"] / forward,
            "routing": spent["moe_routing"] / forward,
            "experts": (spent["moe"] - spent["moe_routing"]) / forward,
        }
        split["rest"] = 1.0 - sum(split.values())
        return split


_SPLIT_PARTS = ("attention", "moe_routing", "moe")


def _wrap(profiler: StepProfiler, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.record(name, start, time.perf_counter())

    return timed


@contextlib.contextmanager
def profile_steps(
    extra: tuple[tuple[Any, str, str], ...] = (), *, split: bool = False
) -> Iterator[StepProfiler]:
    """Time the model forward and the engine's per-step helpers while the block runs.

    Instrumentation for the bench only: it wraps functions of tgengine's modules in place and
    restores them on exit. A helper that does not exist (renamed) is simply not timed.
    ``extra`` names more helpers to time: ``(module or class, attribute, name)``.
    ``split``: each forward also runs with ``CausalLM.timers`` (its products and attention,
    in ``StepProfiler.parts``), and the agent's whole sampling is timed as ``sampling``.
    """
    from ..agent import agent as model_agent
    from ..core import scheduler
    from ..models import causal_lm, moe, self_attention
    from ..sample import sampler
    from ..tokenization import detokenizer

    profiler = StepProfiler()
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        patches.append((owner, attr, original))
        setattr(owner, attr, _wrap(profiler, name, original))

    forward = causal_lm.CausalLM.forward

    def timed_forward(self: Any, inputs: Any, kv_cache: Any) -> Any:
        timers = ForwardTimes() if split else None
        self.timers = timers
        start = time.perf_counter()
        try:
            return forward(self, inputs, kv_cache)
        finally:
            if inputs.input_ids.device.type == "cuda":
                torch.cuda.synchronize(inputs.input_ids.device)  # else it times the launches
            end = time.perf_counter()
            self.timers = None
            rows = int(inputs.num_rows)
            profiler.forwards.append((start, end, rows, int(inputs.decode_rows.shape[0])))
            if timers is not None:
                logits = inputs.logits_rows
                kv = int(inputs.decode_context_lens.sum())
                kv += sum(span.context_len for span in inputs.prefills)
                profiler.parts.append(
                    ForwardParts(
                        timers.products_s,
                        timers.attention_s,
                        rows if logits is None else int(logits.numel()),
                        kv,
                    )
                )

    patches.append((causal_lm.CausalLM, "forward", forward))
    causal_lm.CausalLM.forward = timed_forward  # type: ignore[method-assign]
    patch(model_agent, "prepare_inputs", "prepare_inputs")
    if split:
        patch(model_agent, "sample_step", "sampling")
    patch(sampler.Sampler, "__call__", "sample")
    patch(detokenizer.IncrementalDetokenizer, "add", "detokenize")
    patch(scheduler.Scheduler, "schedule", "schedule")
    patch(scheduler.Scheduler, "update_after_step", "update_after_step")
    # Inside the forward: each layer's attention, and an MoE block's routing and whole time.
    patch(self_attention.Attention, "forward", "attention")
    patch(moe.SparseMoE, "route", "moe_routing")
    patch(moe.SparseMoE, "forward", "moe")
    for owner, attr, name in extra:
        patch(owner, attr, name)
    try:
        yield profiler
    finally:
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)
