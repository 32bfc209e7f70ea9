"""``bench latency``: one stream's time to first token and decode rate, then N streams at once.

Single stream: for each prompt length, tgengine and transformers ``generate`` (batch 1) each
generate ``max_tokens`` greedy tokens ``repeats`` times; the median run counts. Concurrent:
``concurrency`` streams submitted together to tgengine; time-to-first-token and inter-token
latency percentiles over all of them.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import anyio

from ..engine.engine import Engine
from ..open_engine import open_engine
from .common import BenchSetup, best_tgengine, tgengine_runs
from .control_plane import compare, executor_timings, uni_setup, wants_comparison
from .engine_run import engine_config, percentiles, run_all, stream_one, warm_up
from .hf_baselines import load_hf_model, single_stream
from .peers import LimitsByThreads, PeerPlan, best_by_kind, latency_job, run_peers
from .roofline import ModelCosts, memory_floor
from .throughput import SYSTEMS, _free, _hf_warm_up
from .workload import BenchRequest, fixed_workload


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = runs[0].keys()
    return {k: statistics.median(r[k] for r in runs) for k in keys}


async def _tg_single(engine: Engine, requests: list[BenchRequest]) -> dict[str, float]:
    runs = []
    for request in requests:
        timing = await stream_one(engine, request)
        decode_s = timing.token_times[-1] - timing.token_times[0]
        runs.append(
            {
                "ttft_s": timing.ttft or 0.0,
                "decode_tokens_per_s": (len(timing.token_times) - 1) / decode_s
                if decode_s > 0
                else 0.0,
            }
        )
    return _median_run(runs)


async def _tgengine(
    setup: BenchSetup, singles: dict[int, list[BenchRequest]], concurrent: list[BenchRequest]
) -> dict[str, Any]:
    config = engine_config(setup)
    async with open_engine(config) as engine:
        await warm_up(engine)
        single = {n: await _tg_single(engine, r) for n, r in singles.items()}
        wall, timings = await run_all(
            engine, concurrent, desc="tgengine streams", progress=setup.progress
        )
        executor = executor_timings(engine)
    tokens = sum(len(t.token_times) for t in timings)
    return {
        "executor_timings": executor,
        "single": single,
        "concurrent": {
            "num_streams": len(concurrent),
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_s": percentiles([t.ttft for t in timings if t.ttft is not None]),
            "inter_token_s": percentiles([d for t in timings for d in t.inter_token]),
        },
    }


def _peer_rows(
    setup: BenchSetup,
    plan: PeerPlan,
    singles: dict[int, list[BenchRequest]],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Each peer's single streams (median of the repeats) appended to ``rows``; what each
    peer run reported besides its figures (version, start-up time, or its error)."""
    info = {}
    for run in run_peers(
        plan,
        lambda t: latency_job(setup.model_dir, setup.dtype, t, singles),
        progress=setup.progress,
    ):
        info[run.label] = run.info()
        if run.result is None:
            continue
        for n, requests in singles.items():
            runs = [
                {k: r[k] for k in ("ttft_s", "decode_tokens_per_s")}
                for r in run.result["single"][str(n)]
            ]
            rows.append(
                {
                    "system": run.label,
                    "prompt_len": len(requests[0].prompt),
                    **_median_run(runs),
                    "peer": run.peer.kind,
                    "threads": run.threads,
                }
            )
    return info


def _control_plane(mp: dict[str, Any], uni: dict[str, Any]) -> dict[str, Any]:
    """The single-stream decode step (the shortest prompt: the smallest step) of each."""
    shortest = min(mp["single"])
    mp_rate = mp["single"][shortest]["decode_tokens_per_s"]
    uni_rate = uni["single"][shortest]["decode_tokens_per_s"]
    what = f"single-stream decode, prompt {shortest}"
    return compare(1 / mp_rate, 1 / uni_rate, mp["executor_timings"], what)


def run_latency(
    setup: BenchSetup,
    *,
    prompt_lens: tuple[int, ...] = (16, 256, 1024),
    max_tokens: int = 64,
    concurrency: int = 8,
    concurrent_prompt_len: int = 256,
    repeats: int = 3,
    seed: int = 0,
    systems: tuple[str, ...] = SYSTEMS,
    peers: PeerPlan | None = None,
    tgengine_threads: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Single streams on every system in ``systems`` (tgengine once per count in
    ``tgengine_threads``, if given), then on each of ``peers`` at each of its thread counts;
    ``concurrency`` streams at once on (the first run of) tgengine. At each prompt length,
    tgengine's best run is the one compared."""
    mc = setup.model_config()
    limit = mc.max_position_embeddings - max_tokens - 1
    # A new prompt for every repeat: a repeated one would hit tgengine's prefix cache.
    singles = {
        n: fixed_workload(repeats, max(1, min(n, limit)), max_tokens, mc.vocab_size, seed + i)
        for i, n in enumerate(prompt_lens)
    }
    concurrent = fixed_workload(
        concurrency,
        max(1, min(concurrent_prompt_len, limit)),
        max_tokens,
        mc.vocab_size,
        seed + 100,
    )
    limits = setup.measure_machine()
    costs = ModelCosts.of(mc, setup.torch_dtype, setup.quantization)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"bench": "latency"}
    if "tgengine" in systems:
        for label, run_setup in tgengine_runs(setup, tgengine_threads):
            tg = anyio.run(partial(_tgengine, run_setup, singles, concurrent))
            threads = {} if label == "tgengine" else {"threads": run_setup.threads}
            for n, r in tg["single"].items():
                rows.append(
                    {"system": label, "prompt_len": len(singles[n][0].prompt), **r, **threads}
                )
            result.setdefault("concurrent", {"system": label, **tg["concurrent"]})
            if wants_comparison(setup) and "control_plane" not in result:
                uni = anyio.run(partial(_tgengine, uni_setup(setup), singles, concurrent))
                result["control_plane"] = _control_plane(tg, uni)
    if "hf_generate" in systems:
        model = load_hf_model(setup.model_dir, setup.torch_dtype, setup.device)
        _hf_warm_up(model)
        for requests in singles.values():
            runs = [single_stream(model, r.prompt, max_tokens) for r in requests]
            rows.append(
                {
                    "system": "hf_generate bs=1",
                    "prompt_len": len(requests[0].prompt),
                    **_median_run(runs),
                }
            )
        _free(model)
    by_threads = LimitsByThreads(setup, limits)
    if peers is not None and peers.peers:
        result["peers"] = _peer_rows(setup, peers, singles, rows)
    for row in rows:
        context = row["prompt_len"] + max_tokens // 2
        row_limits = by_threads.at(row["threads"]) if "threads" in row else limits
        row.update(memory_floor(costs, row_limits, context, row["decode_tokens_per_s"]))
        row.pop("num_tokens", None)
    ratios = {}
    for length in sorted({r["prompt_len"] for r in rows}):
        best = best_tgengine([r for r in rows if r["prompt_len"] == length], "decode_tokens_per_s")
        mine = [best] if best else []
        theirs = [
            r for r in rows if r["system"] == "hf_generate bs=1" and r["prompt_len"] == length
        ]
        if mine and theirs and theirs[0]["decode_tokens_per_s"] > 0:
            ratios[f"decode tgengine / hf_generate bs=1 @ prompt {length}"] = (
                mine[0]["decode_tokens_per_s"] / theirs[0]["decode_tokens_per_s"]
            )
            if mine[0]["ttft_s"] > 0:
                ratios[f"TTFT hf_generate / tgengine @ prompt {length}"] = (
                    theirs[0]["ttft_s"] / mine[0]["ttft_s"]
                )
        at_length = [r for r in rows if r["prompt_len"] == length]
        for kind, theirs_best in best_by_kind(at_length, "decode_tokens_per_s").items():
            if mine and theirs_best["decode_tokens_per_s"] > 0:
                ratios[f"decode tgengine / {kind} (best) @ prompt {length}"] = (
                    mine[0]["decode_tokens_per_s"] / theirs_best["decode_tokens_per_s"]
                )
                if mine[0]["ttft_s"] > 0:
                    ratios[f"TTFT {kind} (best) / tgengine @ prompt {length}"] = (
                        theirs_best["ttft_s"] / mine[0]["ttft_s"]
                    )
    result.update(
        {
            "workload": {
                "prompt_lens": [len(r[0].prompt) for r in singles.values()],
                "max_tokens": max_tokens,
                "repeats": repeats,
                "concurrency": concurrency,
                "concurrent_prompt_len": len(concurrent[0].prompt),
                "seed": seed,
            },
            "rows": rows,
            "ratios": ratios,
            "roofline": {"machine": limits.as_dict(), "model": costs.as_dict()},
        }
    )
    return result
