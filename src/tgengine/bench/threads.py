"""``bench threads``: the engine's default thread count against fixed ones, over fresh starts.

The default (``EngineConfig.num_threads=None``) is measured by each engine at its start
(``agent.cpu_threads``): a short timing of what a decode step does at 1..cores threads. On a
shared machine that measurement can pick a count that serves slower than another. Each run
here is a fresh process (``python -m tgengine.bench.threads --child ...``) that opens an
engine, warms it up and serves one seeded mixed workload; the default runs ``--starts``
times, each fixed count ``--fixed-starts`` times, interleaved (default, 1, 2, default, ...)
so that a slow minute of the machine falls on all of them. Reported: each start's thread
count and output tokens/s, the best fixed count's median, and how far the slowest default
start fell below it (the issue's bound: 5 %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .common import BenchSetup
from .tables import table

_MARK = "tgengine-bench-threads:"
SLOWER_BOUND = 0.05  # a default start may be this much slower than the best fixed count


def add_parser(benches: Any, common: Callable[[Any], None], handler: Callable[..., int]) -> None:
    """Register ``bench threads``: ``common`` adds the options every bench takes."""
    p = benches.add_parser(
        "threads", help="the default thread count against fixed ones, fresh starts"
    )
    common(p)
    p.add_argument("--starts", type=int, help="fresh starts at the default (default: 10)")
    p.add_argument("--fixed", default="1,2", help="fixed counts to compare (default: 1,2)")
    p.add_argument("--fixed-starts", type=int, help="fresh starts of each (default: 3)")
    p.add_argument("--num-requests", type=int, help="requests per start (default: 32)")
    p.set_defaults(handler=handler, runner=_from_args)


def _from_args(setup: BenchSetup, args: Any) -> dict[str, Any]:
    quick = bool(args.quick)
    return run_threads(
        setup,
        starts=args.starts or (2 if quick else 10),
        fixed=[int(n) for n in args.fixed.split(",") if n],
        fixed_starts=args.fixed_starts or (1 if quick else 3),
        num_requests=args.num_requests or (4 if quick else 32),
        seed=args.seed,
        quick=quick,
    )


def run_threads(
    setup: BenchSetup,
    *,
    starts: int,
    fixed: list[int],
    fixed_starts: int,
    num_requests: int,
    seed: int,
    quick: bool = False,
    timeout: float = 900.0,
) -> dict[str, Any]:
    order: list[int | None] = []
    for i in range(max(starts, fixed_starts)):
        if i < starts:
            order.append(None)
        order += [n for n in fixed if i < fixed_starts]
    rows = []
    for i, threads in enumerate(order):
        command = _child_command(setup, threads, num_requests, seed, quick)
        got = _run_child(command, timeout)
        rows.append({"start": i + 1, "mode": "default" if threads is None else "fixed", **got})
    return {
        "bench": "threads",
        "workload": {
            "num_requests": num_requests,
            "seed": seed,
            "starts": starts,
            "fixed": fixed,
            "fixed_starts": fixed_starts,
        },
        "command": "python -m tgengine.bench.threads --child ...",
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best fixed count's median tokens/s, and the default starts against it."""
    by_count: dict[int, list[float]] = {}
    for row in rows:
        if row["mode"] == "fixed":
            by_count.setdefault(row["threads"], []).append(row["out_tok_s"])
    medians = {n: statistics.median(v) for n, v in by_count.items()}
    defaults = [r for r in rows if r["mode"] == "default"]
    best = max(medians, key=lambda n: medians[n]) if medians else None
    out: dict[str, Any] = {"fixed_medians": medians, "best_fixed": best}
    if best is not None and defaults:
        ratios = [r["out_tok_s"] / medians[best] for r in defaults]
        out.update(
            default_min_ratio=min(ratios),
            default_median_ratio=statistics.median(ratios),
            default_counts=[r["threads"] for r in defaults],
            default_starts_slower_than_bound=sum(r < 1 - SLOWER_BOUND for r in ratios),
        )
    return out


def _child_command(
    setup: BenchSetup, threads: int | None, num_requests: int, seed: int, quick: bool
) -> list[str]:
    command = [sys.executable, "-m", "tgengine.bench.threads", "--child"]
    command += ["--model", setup.model_dir, "--dtype", setup.dtype]
    command += ["--num-requests", str(num_requests), "--seed", str(seed)]
    if threads is not None:
        command += ["--threads", str(threads)]
    return [*command, "--quick"] if quick else command


def _run_child(command: list[str], timeout: float) -> dict[str, Any]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(_MARK)]
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {tail}")
    got: dict[str, Any] = json.loads(lines[-1].removeprefix(_MARK))
    return got


def _child(argv: list[str]) -> None:
    import anyio

    from ..config import EngineConfig
    from ..models import load_model_config
    from ..open_engine import open_engine
    from .common import max_model_len
    from .engine_run import run_all, warm_up
    from .workload import WorkloadSpec, make_workload

    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", num_threads=args.threads
    )
    scale = 0.1 if args.quick else 1.0
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed).scaled(scale)
    model_config = load_model_config(args.model)
    requests = make_workload(spec, model_config.vocab_size, max_model_len(model_config))

    async def serve() -> dict[str, Any]:
        async with open_engine(config) as engine:
            await warm_up(engine)
            wall, _ = await run_all(engine, requests, progress=False)
        tokens = sum(r.max_tokens for r in requests)
        return {"out_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens}

    got = anyio.run(serve)
    got["threads"] = args.threads or _measured_count(args.dtype)
    if args.threads is None:  # what the start-up probe saw, to study a start that misread
        got["probe_gflops"] = _probe_gflops(args.dtype)
    print(_MARK + json.dumps(got), flush=True)


def _measured_count(dtype: str) -> int:
    """The count this process's engine measured at its start (``default_thread_count``
    keeps it, once per process and dtype: asking again measures nothing)."""
    import torch

    from ..agent.cpu_threads import default_thread_count

    if default_thread_count.cache_info().currsize == 0:
        raise RuntimeError("the engine did not measure its thread count in this process")
    return default_thread_count(getattr(torch, dtype))


def _probe_gflops(dtype: str) -> dict[str, float]:
    """Each count's median GFLOP/s in this process's start-up probe (none with one core)."""
    import torch

    from ..agent.cpu_threads import probe_rates

    return {n: r / 1e9 for n, r in probe_rates.get(getattr(torch, dtype), {}).items()}


if __name__ == "__main__":
    _child(sys.argv[1:])


def render(result: dict[str, Any]) -> str:
    out = table(
        result["rows"],
        [
            ("start", "start"),
            ("mode", "threads from"),
            ("threads", "threads"),
            ("out_tok_s", "out tok/s"),
            ("wall_s", "wall s"),
        ],
    )
    s = result["summary"]
    medians = ", ".join(f"t={n}: {v:.0f}" for n, v in s["fixed_medians"].items())
    lines = [out, f"fixed counts, median out tok/s: {medians}"]
    if "default_min_ratio" in s:
        lines.append(
            f"default against the best fixed (t={s['best_fixed']}): slowest start "
            f"{s['default_min_ratio']:.3f}, median {s['default_median_ratio']:.3f}; starts more "
            f"than {SLOWER_BOUND:.0%} slower: {s['default_starts_slower_than_bound']} of "
            f"{len(s['default_counts'])} (counts picked: {s['default_counts']})"
        )
    return "\n".join(lines)


def draw(axes: Any, result: dict[str, Any]) -> None:
    rows = result["rows"]
    colors = ["tab:blue" if r["mode"] == "default" else "tab:gray" for r in rows]
    labels = [
        f"{r['start']}: {'default' if r['mode'] == 'default' else 'fixed'} t={r['threads']}"
        for r in rows
    ]
    axes[0].barh(labels, [r["out_tok_s"] for r in rows], color=colors)
    axes[0].set_xlabel("output tokens/s (blue: the default's pick)")
    axes[0].invert_yaxis()
    defaults = [r["threads"] for r in rows if r["mode"] == "default"]
    counts = sorted(set(defaults))
    axes[1].bar([str(n) for n in counts], [defaults.count(n) for n in counts], color="tab:blue")
    axes[1].set_xlabel("threads the default picked")
    axes[1].set_ylabel("starts")
