"""``bench throughput`` and ``bench batch32``: tokens/s of tgengine and of transformers, one run.

``throughput`` runs the mixed workload (``WorkloadSpec``) through tgengine, transformers
``generate`` on static batches (each size in ``batch_sizes``; the best one is the peer) and
transformers' continuous batching. ``batch32`` is issue #2's question: one request alone, and
32 concurrent requests of the same length, beside ``generate`` at batch 1 and batch 32, with
where tgengine's step time goes at 32 running requests.
"""

from __future__ import annotations

import gc
import time
from functools import partial
from typing import Any

import anyio
import torch

from ..open_engine import open_engine
from .common import BenchSetup, best_tgengine, is_tgengine, machine_info, tgengine_runs
from .control_plane import compare, executor_timings, uni_setup, wants_comparison
from .engine_run import engine_config, percentiles, profile_steps, run_all, stream_one, warm_up
from .hf_baselines import generate_batch, generate_static, load_hf_model, single_stream
from .peers import LimitsByThreads, PeerPlan, best_by_kind, run_peers, throughput_job
from .peers.spec import Threads
from .roofline import ModelCosts, compute_floor, memory_floor
from .workload import BenchRequest, WorkloadSpec, fixed_workload, make_workload, summarize

SYSTEMS = ("tgengine", "hf_generate", "hf_generate_batch")


def _row(
    system: str, wall: float, tokens: int, num_requests: int, prompt_tokens: int
) -> dict[str, Any]:
    return {
        "system": system,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": num_requests / wall if wall > 0 else 0.0,
        "total_tokens_per_s": (tokens + prompt_tokens) / wall if wall > 0 else 0.0,
    }


async def _tgengine_mixed(setup: BenchSetup, requests: list[BenchRequest]) -> dict[str, Any]:
    config = engine_config(setup)
    async with open_engine(config) as engine:
        await warm_up(engine)
        before = engine.stats()
        with profile_steps() as profiler:
            wall, timings = await run_all(engine, requests, progress=setup.progress)
        after = engine.stats()
        executor = executor_timings(engine)
    forward_s = sum(end - start for start, end, _, _ in profiler.forwards)
    num_steps = after.num_steps - before.num_steps
    return {
        "wall_s": wall,
        "output_tokens": sum(len(t.token_times) for t in timings),
        "num_steps": num_steps,
        "step_s": wall / num_steps if num_steps else 0.0,
        "executor": setup.executor_kind,
        "executor_timings": executor,
        "num_preemptions": after.num_preemptions_total - before.num_preemptions_total,
        # The forward runs in this process only on uni (profile_steps cannot see a worker's).
        "forward_fraction_of_wall": forward_s / wall
        if wall > 0 and setup.executor_kind == "uni"
        else None,
        "moe_forward_split": profiler.forward_split(),
        "ttft_s": percentiles([t.ttft for t in timings if t.ttft is not None]),
        "inter_token_s": percentiles([d for t in timings for d in t.inter_token]),
    }


def _free(model: Any) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _hf_warm_up(model: Any) -> None:
    single_stream(model, list(range(16, 48)), 4)


def run_throughput(
    setup: BenchSetup,
    spec: WorkloadSpec,
    *,
    batch_sizes: tuple[int, ...] = (8, 16, 32),
    systems: tuple[str, ...] = SYSTEMS,
    peers: PeerPlan | None = None,
    tgengine_threads: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The mixed workload through every system in ``systems`` (tgengine once per count in
    ``tgengine_threads``, if given), then through each of ``peers`` at each of its thread
    counts; JSON-ready results. tgengine's best run is the one compared."""
    mc = setup.model_config()
    requests = make_workload(spec, mc.vocab_size, mc.max_position_embeddings)
    info = summarize(requests)
    limits = setup.measure_machine()
    costs = ModelCosts.of(mc, setup.torch_dtype, setup.quantization)
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    control: dict[str, Any] | None = None
    n, prompt_tokens = info["num_requests"], info["prompt_tokens"]
    arounds: dict[str, tuple[float, float]] = {}  # the GEMM rate before and after a run
    if "tgengine" in systems:
        for label, run_setup in tgengine_runs(setup, tgengine_threads):
            run = partial(anyio.run, partial(_tgengine_mixed, run_setup, requests))
            tg, arounds[label] = setup.around(limits, None, run)  # at the run's threads
            rows.append(_row(label, tg["wall_s"], tg["output_tokens"], n, prompt_tokens))
            if label != "tgengine":
                rows[-1]["threads"] = run_setup.threads
            details[label] = tg
        if wants_comparison(setup):
            uni = anyio.run(partial(_tgengine_mixed, uni_setup(setup), requests))
            details["tgengine uni"] = uni
            mp = details["tgengine"] if "tgengine" in details else next(iter(details.values()))
            control = compare(mp["step_s"], uni["step_s"], mp["executor_timings"], "mixed")
    if "hf_generate" in systems or "hf_generate_batch" in systems:
        model = load_hf_model(setup.model_dir, setup.torch_dtype, setup.device)
        _hf_warm_up(model)
        if "hf_generate" in systems:
            for bs in batch_sizes:
                static = generate_static(model, requests, bs, progress=setup.progress)
                row = _row(
                    f"hf_generate bs={bs}",
                    static["wall_s"],
                    static["output_tokens"],
                    n,
                    prompt_tokens,
                )
                row["generated_tokens_incl_waste"] = static["generated_tokens_incl_waste"]
                rows.append(row)
        if "hf_generate_batch" in systems:
            cb = generate_batch(model, requests, progress=setup.progress)
            rows.append(
                _row("hf_generate_batch", cb["wall_s"], cb["output_tokens"], n, prompt_tokens)
            )
            details["hf_generate_batch"] = cb
        _free(model)
    by_threads = LimitsByThreads(setup, limits)
    for row in rows:
        at = by_threads.at(row["threads"]) if "threads" in row else limits
        around = arounds.get(row["system"])
        row.update(compute_floor(costs, at, requests, row["wall_s"], around))
    peer_info = {}
    if peers is not None and peers.peers:
        peer_info = _peer_rows(setup, peers, requests, rows, costs, by_threads)
    return {
        "bench": "throughput",
        "peers": peer_info,
        "workload": {"spec": spec.describe(), **info},
        "rows": rows,
        "ratios": _ratios(rows),
        "details": details,
        "control_plane": control,
        "roofline": {"machine": limits.as_dict(), "model": costs.as_dict()},
    }


def _peer_rows(
    setup: BenchSetup,
    plan: PeerPlan,
    requests: list[BenchRequest],
    rows: list[dict[str, Any]],
    costs: ModelCosts,
    by_threads: LimitsByThreads,
) -> dict[str, Any]:
    """Each peer at each thread count on ``requests``, appended to ``rows``; what each
    peer run reported besides its figures (version, start-up time, or its error)."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    info = {}

    def matmul_now(threads: Threads) -> float:
        return setup.matmul_now(by_threads.base, threads if isinstance(threads, int) else None)

    for run in run_peers(
        plan,
        lambda t: throughput_job(setup.model_dir, setup.dtype, t, requests),
        progress=setup.progress,
        measure=matmul_now,
    ):
        info[run.label] = run.info()
        if run.result is None:
            continue
        wall = run.result["wall_s"]
        row = _row(run.label, wall, run.result["output_tokens"], len(requests), prompt_tokens)
        row.update({"peer": run.peer.kind, "threads": run.threads})
        at = by_threads.at(run.threads)
        row.update(compute_floor(costs, at, requests, wall, run.matmul_before_after))
        rows.append(row)
    return info


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """tgengine's tokens/s over each peer's (a peer's row at ``t=N`` over tgengine's at
    ``t=N`` where that ran, else over tgengine's best), and over the best static
    ``generate``."""
    by_name = {r["system"]: r for r in rows}
    tg = best_tgengine(rows, "tokens_per_s")
    if tg is None:
        return {}
    ratios: dict[str, float] = {}
    for name, r in by_name.items():
        if is_tgengine(name) or r["tokens_per_s"] <= 0:
            continue
        same = by_name.get(f"tgengine t={r.get('threads')}")
        # tgengine at that thread count, or its one run; else its best, said in the label
        label = "tgengine" if same is not None or "tgengine" in by_name else "tgengine (best)"
        ratios[f"{label} / {name}"] = (same or tg)["tokens_per_s"] / r["tokens_per_s"]
    if "threads" in tg:
        ratios["best tgengine threads"] = float(tg["threads"])
    static = [r for r in rows if r["system"].startswith("hf_generate bs=")]
    if static:
        best = max(static, key=lambda r: r["tokens_per_s"])
        ratios["tgengine / hf_generate (best batch size)"] = (
            tg["tokens_per_s"] / best["tokens_per_s"]
        )
        ratios["best hf_generate batch size"] = float(best["system"].split("=")[1])
    for kind, row in best_by_kind(rows, "tokens_per_s").items():
        if row["tokens_per_s"] > 0:
            ratios[f"tgengine / {kind} (best)"] = tg["tokens_per_s"] / row["tokens_per_s"]
            if isinstance(row["threads"], int):
                ratios[f"best {kind} threads"] = float(row["threads"])
    return ratios


# -- batch32 ---------------------------------------------------------------------------


async def _tgengine_batch32(
    setup: BenchSetup, single: BenchRequest, batch: list[BenchRequest]
) -> dict[str, Any]:
    config = engine_config(setup)
    async with open_engine(config) as engine:
        await warm_up(engine)
        start = time.perf_counter()
        alone = await stream_one(engine, single)
        alone_wall = time.perf_counter() - start
        with profile_steps() as profiler:
            wall, timings = await run_all(
                engine, batch, desc="tgengine x32", progress=setup.progress
            )
    decode_s = alone.token_times[-1] - alone.token_times[0]
    return {
        "single": {
            "wall_s": alone_wall,
            "output_tokens": len(alone.token_times),
            "tokens_per_s": len(alone.token_times) / alone_wall,
            "ttft_s": alone.ttft,
            "decode_tokens_per_s": (len(alone.token_times) - 1) / decode_s if decode_s > 0 else 0.0,
        },
        "batch": {
            "wall_s": wall,
            "output_tokens": sum(len(t.token_times) for t in timings),
            "ttft_s": percentiles([t.ttft for t in timings if t.ttft is not None]),
            "inter_token_s": percentiles([d for t in timings for d in t.inter_token]),
        },
        "step_breakdown": profiler.steady_state(len(batch)),
    }


def run_batch32(
    setup: BenchSetup,
    *,
    num_requests: int = 32,
    prompt_len: int = 64,
    max_tokens: int = 64,
    seed: int = 0,
    systems: tuple[str, ...] = SYSTEMS,
) -> dict[str, Any]:
    """One request alone, then ``num_requests`` at once, on tgengine and ``generate``."""
    mc = setup.model_config()
    prompt_len = max(1, min(prompt_len, mc.max_position_embeddings - max_tokens - 1))
    batch = fixed_workload(num_requests, prompt_len, max_tokens, mc.vocab_size, seed)
    limits = setup.measure_machine()
    costs = ModelCosts.of(mc, setup.torch_dtype, setup.quantization)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"bench": "batch32"}
    if "tgengine" in systems:
        tg = anyio.run(partial(_tgengine_batch32, setup, batch[0], batch))
        s, b = tg["single"], tg["batch"]
        rows.append(_row("tgengine x1", s["wall_s"], s["output_tokens"], 1, prompt_len))
        rows[-1]["decode_tokens_per_s"] = s["decode_tokens_per_s"]
        rows.append(
            _row(
                f"tgengine x{num_requests}",
                b["wall_s"],
                b["output_tokens"],
                num_requests,
                prompt_len * num_requests,
            )
        )
        result["tgengine"] = tg
        result["step_breakdown"] = tg["step_breakdown"]
    if "hf_generate" in systems:
        model = load_hf_model(setup.model_dir, setup.torch_dtype, setup.device)
        _hf_warm_up(model)
        start = time.perf_counter()
        alone = single_stream(model, batch[0].prompt, max_tokens)
        alone_wall = time.perf_counter() - start
        rows.append(_row("hf_generate bs=1", alone_wall, int(alone["num_tokens"]), 1, prompt_len))
        rows[-1]["decode_tokens_per_s"] = alone["decode_tokens_per_s"]
        static = generate_static(model, batch, num_requests, progress=setup.progress)
        rows.append(
            _row(
                f"hf_generate bs={num_requests}",
                static["wall_s"],
                static["output_tokens"],
                num_requests,
                prompt_len * num_requests,
            )
        )
        _free(model)
    for row in rows:
        reqs = batch[:1] if row["system"].endswith(("x1", "bs=1")) else batch
        row.update(compute_floor(costs, limits, reqs, row["wall_s"]))
        if "decode_tokens_per_s" in row:
            row.update(
                memory_floor(
                    costs, limits, prompt_len + max_tokens // 2, row["decode_tokens_per_s"]
                )
            )
    by_name = {r["system"]: r for r in rows}
    ratios = {}
    for mine, theirs in (
        ("tgengine x1", "hf_generate bs=1"),
        (f"tgengine x{num_requests}", f"hf_generate bs={num_requests}"),
    ):
        if mine in by_name and theirs in by_name:
            ratios[f"{mine} / {theirs}"] = (
                by_name[mine]["tokens_per_s"] / by_name[theirs]["tokens_per_s"]
            )
    result.update(
        {
            "workload": {
                "num_requests": num_requests,
                "prompt_len": prompt_len,
                "max_tokens": max_tokens,
                "seed": seed,
            },
            "rows": rows,
            "ratios": ratios,
            "roofline": {"machine": limits.as_dict(), "model": costs.as_dict()},
        }
    )
    return result


def with_machine(setup: BenchSetup, result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "setup": setup.as_dict(), "machine": machine_info(setup.device)}
