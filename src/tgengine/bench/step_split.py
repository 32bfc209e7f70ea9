"""``bench step``: where a step's time goes, decode-only and prefill-carrying, beside its floor.

One run of ``num_seqs`` requests submitted at once (prompts of ``prompt_len`` tokens, lo to
hi, ``max_tokens`` each): their prompts make prefill-carrying steps, then every sequence
decodes together. Each step's period (one forward's start to the next one's) is split into

- **products**: every linear product (``Gemm.linear``, and those inside the one-call decode),
- **attention**: rotary, the KV store and the attention itself, per layer,
- **rest of model**: the rest of the forward (embedding, norms, activations, glue, Python),
- **sampling**: the agent's sampling of the logits (``sample_step``),
- **engine**: the rest of the period (scheduling, inputs, detokenizing, the event loop),

measured through ``CausalLM.timers`` (``models.step_timers``) and ``profile_steps``; the
parts sum to the step. Its **floor**: the products' FLOPs at the GEMM rate measured just
before and after the run (but no less than the weights read once at the memory rate) plus
the KV bytes its attention reads at the measured memory rate.
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import anyio

from ..open_engine import open_engine
from .common import BenchSetup
from .engine_run import StepProfiler, engine_config, profile_steps, run_all, warm_up
from .roofline import MachineLimits, ModelCosts
from .tables import table
from .workload import WorkloadSpec, make_workload

PARTS = ("products", "attention", "rest_of_model", "sampling", "engine")
KINDS = ("decode", "prefill")  # decode-only steps; steps that carry a prompt (chunk)


async def _profiled(setup: BenchSetup, requests: list[Any]) -> StepProfiler:
    async with open_engine(engine_config(setup)) as engine:
        await warm_up(engine)
        with profile_steps(split=True) as profiler:
            await run_all(engine, requests, desc="tgengine step", progress=setup.progress)
    return profiler


def step_rows(
    profiler: StepProfiler, costs: ModelCosts, matmul_flops: float, bandwidth: float
) -> list[dict[str, Any]]:
    """One row per kind of step (``KINDS``) that ran: each part's mean ms, the step's, the
    floor's, and the products' rate; a step is counted when the next forward started."""
    sampling = profiler.intervals.get("sampling", [])
    steps: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    forwards = profiler.forwards
    for i in range(len(forwards) - 1):
        start, end, rows, decode = forwards[i]
        period = forwards[i + 1][0] - start
        part = profiler.parts[i]
        forward = end - start
        sample = sum(max(0.0, min(e, start + period) - max(s, end)) for s, e in sampling)
        flops = 2.0 * (costs.layer_matmul_params * rows + costs.head_params * part.logits_rows)
        weights_s = costs.weight_bytes / bandwidth
        kv_s = part.kv_tokens * costs.kv_bytes_per_token / bandwidth
        steps["decode" if rows == decode else "prefill"].append(
            {
                "rows": rows,
                "step": period,
                "forward": forward,
                "products": part.products_s,
                "attention": part.attention_s,
                "rest_of_model": forward - part.products_s - part.attention_s,
                "sampling": sample,
                "engine": period - forward - sample,
                "floor": max(flops / matmul_flops, weights_s) + kv_s,
                "floor_products": flops / matmul_flops,
                "floor_weights": weights_s,
                "floor_kv": kv_s,
                "flops": flops,
            }
        )
    rows_out = []
    for kind, found in steps.items():
        if not found:
            continue
        mean = {key: statistics.fmean(s[key] for s in found) for key in found[0]}
        row: dict[str, Any] = {"kind": kind, "num_steps": len(found), "rows": mean["rows"]}
        for key in ("step", "forward", *PARTS, "floor", "floor_products", "floor_weights"):
            row[f"{key}_ms"] = 1e3 * mean[key]
        row["floor_kv_ms"] = 1e3 * mean["floor_kv"]
        row["step_over_floor"] = mean["step"] / mean["floor"] if mean["floor"] > 0 else 0.0
        row["products_gflops"] = mean["flops"] / mean["products"] / 1e9 if mean["products"] else 0.0
        row["median_step_ms"] = 1e3 * statistics.median(s["step"] for s in found)
        rows_out.append(row)
    return rows_out


def run_step_split(
    setup: BenchSetup,
    *,
    num_seqs: int,
    prompt_len: tuple[int, int],
    max_tokens: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The bench's JSON-ready result (see the module's docstring)."""
    mc = setup.model_config()
    spec = WorkloadSpec(num_seqs, prompt_len, (max_tokens, max_tokens), seed)
    requests = make_workload(spec, mc.vocab_size, mc.max_position_embeddings)
    limits: MachineLimits = setup.measure_machine()
    costs = ModelCosts.of(mc, setup.torch_dtype, setup.quantization)
    run = partial(anyio.run, partial(_profiled, setup, requests))
    profiler, around = setup.around(limits, None, run)
    rate = statistics.fmean(around)
    return {
        "bench": "step",
        "workload": {
            "num_seqs": num_seqs,
            "prompt_len": f"{prompt_len[0]}-{prompt_len[1]}",
            "max_tokens": max_tokens,
            "seed": seed,
            "prepack_weights": setup.prepack_weights,
        },
        "floor_rates": {
            "matmul_flops_before_after": list(around),
            "matmul_flops": rate,
            "memory_bandwidth": limits.memory_bandwidth,
        },
        "rows": step_rows(profiler, costs, rate, limits.memory_bandwidth),
    }


def render(result: dict[str, Any]) -> str:
    rates = result["floor_rates"]
    columns = [("kind", "step"), ("num_steps", "n"), ("rows", "rows"), ("step_ms", "step ms")]
    columns += [(f"{p}_ms", p.replace("_", " ")) for p in PARTS]
    columns += [("floor_ms", "floor ms"), ("step_over_floor", "step/floor")]
    columns += [("products_gflops", "products GFLOP/s")]
    return "\n".join(
        [
            table(result["rows"], columns),
            f"floor: products at {rates['matmul_flops'] / 1e9:.0f} GFLOP/s (GEMM rate before/after "
            f"the run: {'/'.join(f'{r / 1e9:.0f}' for r in rates['matmul_flops_before_after'])}"
            f"), at least the weights, plus the KV read, at {rates['memory_bandwidth'] / 1e9:.1f}"
            " GB/s",
        ]
    )


def plot(result: dict[str, Any], axes: Any) -> None:
    """Each kind's step as stacked parts beside its floor; the parts as shares."""
    rows = result["rows"]
    names = [r["kind"] for r in rows]
    left = [0.0] * len(rows)
    for part in PARTS:
        values = [r[f"{part}_ms"] for r in rows]
        axes[0].barh(names, values, left=left, label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes[0].scatter(
        [r["floor_ms"] for r in rows], names, color="k", marker="|", s=400, label="floor"
    )
    axes[0].set_xlabel("ms per step")
    axes[0].legend()
    for i, r in enumerate(rows):
        shares = [100 * r[f"{p}_ms"] / r["step_ms"] for p in PARTS] if r["step_ms"] else []
        axes[1].bar(
            [f"{r['kind']}\n{p}" for p in PARTS], shares, label=r["kind"], alpha=0.7 + 0.3 * i
        )
    axes[1].set_ylabel("% of the step")
    axes[1].tick_params(axis="x", labelsize=7)
