"""``bench structured``: what structured outputs cost, against a decode step.

The same ``num_requests`` prompts decode twice on one engine: free, then every request
constrained by a JSON schema that cannot end before ``max_tokens`` (an array with more
required items than fit). The steady-state decode steps of both runs are timed, with the two
grammar parts of a constrained step timed inside them: filling the bitmasks (the matchers
catch up with their tokens and write their masks, off the event loop) and applying them to
the logits in the sampler. The issue's bar: both together under 10 % of a free decode step
at 32 requests. Compiling typical schemas (uncached) is timed too.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import anyio

from ..engine.engine import Engine
from ..open_engine import open_engine
from ..sampling import SamplingParams
from ..structured_outputs import StructuredOutputsParams
from ..structured_outputs.compiler import GrammarCompiler
from .common import BenchSetup
from .engine_run import StepProfiler, engine_config, profile_steps, warm_up
from .workload import BenchRequest, fixed_workload

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TYPICAL_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": ITEM,
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
            "email": {"type": "string", "format": "email"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "price": {"type": "number", "minimum": 0},
                    },
                    "required": ["sku", "quantity", "price"],
                },
                "minItems": 1,
            },
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
            "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["id", "email", "items", "status"],
    },
}


def long_schema(max_tokens: int) -> dict[str, Any]:
    """An object whose array needs more items than ``max_tokens`` can hold."""
    return {
        "type": "object",
        "properties": {"people": {"type": "array", "items": ITEM, "minItems": max_tokens}},
        "required": ["people"],
        "additionalProperties": False,
    }


async def _decode(
    engine: Engine, requests: list[BenchRequest], params: SamplingParams, extra: Any
) -> tuple[StepProfiler, list[str | None]]:
    reasons: list[str | None] = [None] * len(requests)

    async def one(i: int) -> None:
        async for chunk in engine.generate(requests[i].prompt, params):
            reasons[i] = chunk.finish_reason or reasons[i]

    with profile_steps(extra) as profiler:
        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(one, i)
    return profiler, reasons


async def _tgengine(
    setup: BenchSetup, requests: list[BenchRequest], max_tokens: int
) -> dict[str, Any]:
    from ..structured_outputs import bitmasks, grammar_mask

    extra = (
        (bitmasks, "fill_bitmasks", "grammar_fill"),
        (grammar_mask, "apply_token_bitmask_", "grammar_mask"),
    )
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    schema = StructuredOutputsParams(json=long_schema(max_tokens))
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=schema)
    async with open_engine(engine_config(setup)) as engine:
        await warm_up(engine)
        free_profile, _ = await _decode(engine, requests, free, extra)
        constrained_profile, reasons = await _decode(engine, requests, constrained, extra)
        compile_ms = await anyio.to_thread.run_sync(_compile_times, engine)
    n = len(requests)
    return {
        "free": free_profile.steady_state(n),
        "constrained": constrained_profile.steady_state(n),
        "constrained_finish_reasons": sorted({str(r) for r in reasons}),
        "compile_ms": compile_ms,
    }


def _compile_times(engine: Engine) -> dict[str, float]:
    """Milliseconds: preparing the tokenizer (once per engine); compiling each typical schema
    the first time (uncached) and again (cached: a copy of the compiled matcher)."""
    mc = engine.model_config
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, mc.vocab_size, mc.eos_token_ids)
    times = {"tokenizer_preparation": 1e3 * (time.perf_counter() - start)}
    for name, schema in TYPICAL_SCHEMAS.items():
        params = StructuredOutputsParams(json=schema)
        for run in ("first", "cached"):
            start = time.perf_counter()
            compiler.matcher(params)
            times[f"{name}_{run}"] = 1e3 * (time.perf_counter() - start)
    return times


def run_structured(
    setup: BenchSetup,
    *,
    num_requests: int = 32,
    prompt_len: int = 32,
    max_tokens: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Free vs constrained decode at ``num_requests``; the grammar's share of a step."""
    mc = setup.model_config()
    requests = fixed_workload(num_requests, prompt_len, max_tokens, mc.vocab_size, seed)
    tg = anyio.run(partial(_tgengine, setup, requests, max_tokens))
    free, constrained = tg["free"], tg["constrained"]
    rows = []
    for name, profile in (("free", free), ("constrained", constrained)):
        rows.append(
            {
                "run": name,
                "num_steps": profile.get("num_steps", 0),
                "step_ms": profile.get("step_ms", 0.0),
                "forward_ms": profile.get("forward_ms", 0.0),
                "sample_ms": profile.get("sample_ms", 0.0),
                "grammar_fill_ms": profile.get("grammar_fill_ms", 0.0),
                "grammar_mask_ms": profile.get("grammar_mask_ms", 0.0),
            }
        )
    grammar_ms = rows[1]["grammar_fill_ms"] + rows[1]["grammar_mask_ms"]
    free_step = rows[0]["step_ms"]
    return {
        "bench": "structured",
        "workload": {
            "num_requests": num_requests,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
        },
        "rows": rows,
        "compile_ms": tg["compile_ms"],
        "constrained_finish_reasons": tg["constrained_finish_reasons"],
        "ratios": {
            "grammar_ms_per_step / free step_ms": grammar_ms / free_step if free_step else 0.0,
            "constrained / free step_ms": rows[1]["step_ms"] / free_step if free_step else 0.0,
        },
    }
