"""Load test: the same load through HTTP (tgengine's server) and through the library API.

    python bench/load_test.py --model DIR            # or --tiny for a tiny random model
    python bench/load_test.py --tiny --requests 200 --concurrency 50 --max-tokens 32

One process runs the Engine and the Server; the load runs twice in the same run:
once as ``engine.generate`` calls in that process, once as streaming HTTP requests from a
client in a separate process (so the client's parsing does not steal the server's event
loop; on a small machine it still shares the CPUs). Every request is greedy with
``ignore_eos`` and the same ``max_tokens``, and each run uses its own prompts (no prefix
cache reuse across runs). Prints requests/s, generated tokens/s, p50/p99 time to first
token and end-to-end latency, and HTTP/library ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import httpx

from tgengine import Engine, EngineConfig, SamplingParams
from tgengine.server import Server, ServerConfig

WORDS = (
    "the quick brown fox jumps over the lazy dog while a small engine serves many people".split()
)


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int


@dataclass
class Summary:
    label: str
    requests: int
    failed: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float


def prompt(run: str, i: int) -> str:
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(8 + i % 24)]
    return f"{run} {i}: " + " ".join(words)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(label: str, samples: list[Sample], failed: int, seconds: float) -> Summary:
    ttft = [s.ttft for s in samples]
    e2e = [s.e2e for s in samples]
    return Summary(
        label=label,
        requests=len(samples),
        failed=failed,
        seconds=seconds,
        requests_per_s=len(samples) / seconds,
        tokens_per_s=sum(s.tokens for s in samples) / seconds,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
    )


async def run_load(
    count: int, concurrency: int, one: Callable[[int], Awaitable[None]]
) -> tuple[float, int]:
    send, receive = anyio.create_memory_object_stream[int](count)
    for i in range(count):
        send.send_nowait(i)
    send.close()
    failed = 0

    async def worker() -> None:
        nonlocal failed
        async for i in receive:
            try:
                await one(i)
            except Exception as exc:  # counted and reported: a load test must not stop early
                failed += 1
                print(f"request {i} failed: {exc!r}", file=sys.stderr)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return time.perf_counter() - start, failed


# -- the library side -------------------------------------------------------------------


async def library_load(engine: Engine, args: argparse.Namespace, run: str) -> Summary:
    samples: list[Sample] = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        start = time.perf_counter()
        first = None
        tokens = 0
        async for out in engine.generate(prompt(run, i), params):
            if out.token_ids and first is None:
                first = time.perf_counter()
            tokens += len(out.token_ids)
        end = time.perf_counter()
        samples.append(Sample((first or end) - start, end - start, tokens))

    seconds, failed = await run_load(args.requests, args.concurrency, one)
    return summarize("library", samples, failed, seconds)


# -- the HTTP side (in a client process) -------------------------------------------------


async def http_load(args: argparse.Namespace) -> Summary:
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.client, limits=limits, timeout=None) as http:

        async def one(i: int) -> None:
            body = {
                "model": args.model_name,
                "prompt": prompt(args.run, i),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            first = None
            tokens = 0
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event["choices"] and first is None:
                        first = time.perf_counter()
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            end = time.perf_counter()
            samples.append(Sample((first or end) - start, end - start, tokens))

        seconds, failed = await run_load(args.requests, args.concurrency, one)
    return summarize("http", samples, failed, seconds)


async def http_in_subprocess(url: str, args: argparse.Namespace, run: str) -> Summary:
    command = [
        sys.executable,
        __file__,
        "--client",
        url,
        "--run",
        run,
        "--model-name",
        "bench",
        "--requests",
        str(args.requests),
        "--concurrency",
        str(args.concurrency),
        "--max-tokens",
        str(args.max_tokens),
    ]
    result = await anyio.run_process(command, stderr=subprocess.PIPE)
    return Summary(**json.loads(result.stdout))


# -- the server process ------------------------------------------------------------------


async def bench(args: argparse.Namespace, model: str) -> list[Summary]:
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        max_num_seqs=max(args.concurrency, 1),
        enable_prefix_caching=False,
        **({"num_blocks": args.num_blocks} if args.num_blocks else {}),
    )
    engine = Engine(config)
    server = Server(engine, ServerConfig(port=0, served_model_name="bench"))
    results: list[Summary] = []
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        await tg.start(server.run)
        warm = SamplingParams(max_tokens=4, temperature=0.0)
        for i in range(3):
            async for _ in engine.generate(prompt("warmup", i), warm):
                pass
        for round_ in range(args.rounds):
            results.append(await library_load(engine, args, f"L{round_}"))
            results.append(await http_in_subprocess(server.url, args, f"H{round_}"))
        tg.cancel_scope.cancel()
    return results


def report(results: list[Summary], args: argparse.Namespace, model: str) -> None:
    print(
        f"model={model} requests={args.requests} concurrency={args.concurrency} "
        f"max_tokens={args.max_tokens} backend={args.backend} rounds={args.rounds}"
    )
    header = "| run | ok | failed | s | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | e2e p50 ms |"
    print(header)
    print("|" + "---|" * 9)
    for s in results:
        print(
            f"| {s.label} | {s.requests} | {s.failed} | {s.seconds:.2f} | {s.requests_per_s:.1f} "
            f"| {s.tokens_per_s:.0f} | {s.ttft_p50 * 1e3:.0f} | {s.ttft_p99 * 1e3:.0f} "
            f"| {s.e2e_p50 * 1e3:.0f} |"
        )
    lib = [s for s in results if s.label == "library"]
    http = [s for s in results if s.label == "http"]

    def mean(rows: list[Summary], field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in rows)

    print(
        "HTTP/library ratio: "
        f"req/s {mean(http, 'requests_per_s') / mean(lib, 'requests_per_s'):.2f}, "
        f"tok/s {mean(http, 'tokens_per_s') / mean(lib, 'tokens_per_s'):.2f}, "
        f"TTFT p50 {mean(http, 'ttft_p50') / mean(lib, 'ttft_p50'):.2f}, "
        f"TTFT p99 {mean(http, 'ttft_p99') / mean(lib, 'ttft_p99'):.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (tests')")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="library/HTTP pairs to run")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--run", default="H", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:  # the client process
        summary = anyio.run(http_load, args)
        print(json.dumps(asdict(summary)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from model_factory import make_tiny_model_dir

            model = str(make_tiny_model_dir(Path(tmp), arch="llama"))
        else:
            from tgengine.cli.common import resolve_model

            model = resolve_model(args.model)
        results = anyio.run(bench, args, model, backend=args.backend)
    report(results, args, model)


if __name__ == "__main__":
    main()
