"""Load test: the same load through HTTP (tgengine's server) and through the library API.

    python bench/load_test.py --model DIR            # or --tiny for a tiny random model
    python bench/load_test.py --tiny --requests 200 --concurrency 50 --max-tokens 32

One process runs the Engine and the Server; the load runs twice in the same run:
once as ``engine.generate`` calls in that process, once as streaming HTTP requests from a
client in a separate process (so the client's parsing does not steal the server's event
loop; on a small machine it still shares the CPUs: the table shows the CPU seconds of
the server process and of the client process per run). Every request is greedy with
``ignore_eos`` and the same ``max_tokens``, and each run uses its own prompts (no prefix
cache reuse across runs). Prints requests/s, generated tokens/s, p50/p99 time to first
token and end-to-end latency, and HTTP/library ratios.

``--engine-process`` compares the two server layouts instead, in the same run: the server
with the engine in its own process and with the engine in-process, each under streaming
HTTP load from ``--levels`` concurrent clients (default 8, 32, 128): requests/s and
time-to-first-token percentiles per layout and level, plus the CPU seconds of the server
process and of the engine process.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import httpx

if TYPE_CHECKING:  # the client process must not pay for importing torch
    from tgengine import Engine

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
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0


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
    from tgengine import SamplingParams

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

    cpu = time.process_time()
    seconds, failed = await run_load(args.requests, args.concurrency, one)
    summary = summarize("library", samples, failed, seconds)
    summary.server_cpu_s = time.process_time() - cpu
    return summary


# -- the HTTP side (in a client process) -------------------------------------------------


def request_body(args: argparse.Namespace, i: int) -> dict[str, object]:
    return {
        "model": args.model_name,
        "prompt": prompt(args.run, i),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def raw_http_load(args: argparse.Namespace) -> Summary:
    """A minimal keep-alive HTTP/1.1 client (one connection per concurrent client) that only
    looks for the first event, ``[DONE]`` and the usage: it costs far less CPU than httpx,
    so on a small machine the numbers measure the server rather than the client."""
    samples: list[Sample] = []
    url = httpx.URL(args.client)
    pool_send, pool_receive = anyio.create_memory_object_stream[anyio.abc.ByteStream](
        args.concurrency
    )
    for _ in range(args.concurrency):
        pool_send.send_nowait(await anyio.connect_tcp(url.host, url.port or 80))

    async def one(i: int) -> None:
        data = json.dumps(request_body(args, i)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        stream = await pool_receive.receive()
        try:
            start = time.perf_counter()
            await stream.send(head.encode() + data)
            buffer = b""
            first = None
            while not (b"data: [DONE]" in buffer and buffer.endswith(b"0\r\n\r\n")):
                buffer += await stream.receive()
                if first is None and b"data: {" in buffer:
                    first = time.perf_counter()
            end = time.perf_counter()
        finally:
            pool_send.send_nowait(stream)
        if not buffer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(buffer[:200].decode(errors="replace"))
        usage = re.search(rb'"completion_tokens":(\d+)', buffer)
        tokens = int(usage.group(1)) if usage else 0
        samples.append(Sample((first or end) - start, end - start, tokens))

    seconds, failed = await run_load(args.requests, args.concurrency, one)
    while True:
        try:
            await pool_receive.receive_nowait().aclose()
        except anyio.WouldBlock:
            break
    return summarize("http", samples, failed, seconds)


async def http_load(args: argparse.Namespace) -> Summary:
    """The same load with httpx (what most Python clients use; heavier on the client)."""
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.client, limits=limits, timeout=None) as http:

        async def one(i: int) -> None:
            body = request_body(args, i)
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
        "--client-kind",
        args.client_kind,
    ]
    cpu = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = await anyio.run_process(command, stderr=subprocess.PIPE)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = Summary(**json.loads(result.stdout))
    summary.server_cpu_s = time.process_time() - cpu
    summary.client_cpu_s = (after.ru_utime + after.ru_stime) - (
        children.ru_utime + children.ru_stime
    )
    return summary


# -- the server process ------------------------------------------------------------------


async def bench(args: argparse.Namespace, model: str) -> list[Summary]:
    from tgengine import Engine, EngineConfig, SamplingParams
    from tgengine.server import Server, ServerConfig

    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        max_num_seqs=max(args.concurrency, 1),
        enable_prefix_caching=False,
        num_threads=args.num_threads,
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


async def layouts(args: argparse.Namespace, model: str) -> list[Summary]:
    """The server in both layouts, each under every concurrency level, in one run."""
    import psutil

    from tgengine import Engine, EngineConfig, ProcessEngine, SamplingParams
    from tgengine.server import Server, ServerConfig

    levels = [int(level) for level in args.levels.split(",")]
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        max_num_seqs=max(levels),
        enable_prefix_caching=False,
        num_threads=args.num_threads,
        **({"num_blocks": args.num_blocks} if args.num_blocks else {}),
    )
    results: list[Summary] = []
    for layout in ("in-process", "engine-process"):
        engine = Engine(config) if layout == "in-process" else ProcessEngine(config)
        server = Server(engine, ServerConfig(port=0, served_model_name="bench"))
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await tg.start(server.run)
            pid = getattr(engine, "pid", None)
            engine_process = psutil.Process(pid) if pid else None
            warm = SamplingParams(max_tokens=4, temperature=0.0)
            for i in range(3):
                async for _ in engine.generate(prompt("warmup", i), warm):
                    pass
            for level in levels:
                run_args = argparse.Namespace(**{**vars(args), "concurrency": level})
                before = sum(engine_process.cpu_times()[:2]) if engine_process else 0.0
                summary = await http_in_subprocess(server.url, run_args, f"{layout}-{level}")
                summary.label = f"{layout} c={level}"
                if engine_process is not None:
                    summary.engine_cpu_s = sum(engine_process.cpu_times()[:2]) - before
                results.append(summary)
            tg.cancel_scope.cancel()
    return results


def report_layouts(results: list[Summary], args: argparse.Namespace, model: str) -> None:
    print(
        f"model={model} requests={args.requests} max_tokens={args.max_tokens} "
        f"backend={args.backend} num_threads={args.num_threads} client={args.client_kind}"
    )
    print(
        "| layout, clients | ok | failed | req/s | tok/s | TTFT p50 ms | TTFT p99 ms "
        "| server CPU s | engine process CPU s |"
    )
    print("|" + "---|" * 9)
    for s in results:
        print(
            f"| {s.label} | {s.requests} | {s.failed} | {s.requests_per_s:.1f} "
            f"| {s.tokens_per_s:.0f} | {s.ttft_p50 * 1e3:.0f} | {s.ttft_p99 * 1e3:.0f} "
            f"| {s.server_cpu_s:.1f} | {s.engine_cpu_s:.1f} |"
        )


def report(results: list[Summary], args: argparse.Namespace, model: str) -> None:
    print(
        f"model={model} requests={args.requests} concurrency={args.concurrency} "
        f"max_tokens={args.max_tokens} backend={args.backend} rounds={args.rounds} "
        f"num_threads={args.num_threads} client={args.client_kind}"
    )
    header = (
        "| run | ok | failed | s | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | e2e p50 ms "
        "| server CPU s | client CPU s |"
    )
    print(header)
    print("|" + "---|" * 11)
    for s in results:
        print(
            f"| {s.label} | {s.requests} | {s.failed} | {s.seconds:.2f} | {s.requests_per_s:.1f} "
            f"| {s.tokens_per_s:.0f} | {s.ttft_p50 * 1e3:.0f} | {s.ttft_p99 * 1e3:.0f} "
            f"| {s.e2e_p50 * 1e3:.0f} | {s.server_cpu_s:.1f} | {s.client_cpu_s:.1f} |"
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
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="library/HTTP pairs to run")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument(
        "--client-kind",
        default="raw",
        choices=["raw", "httpx"],
        help="raw: a minimal HTTP/1.1 client; httpx: httpx.AsyncClient (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="compare the server with the engine in its own process and in-process",
    )
    parser.add_argument(
        "--levels",
        default="8,32,128",
        help="with --engine-process: concurrent clients, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--run", default="H", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:  # the client process
        load = raw_http_load if args.client_kind == "raw" else http_load
        summary = anyio.run(load, args)
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
        if args.engine_process:
            results = anyio.run(layouts, args, model, backend=args.backend)
            report_layouts(results, args, model)
            return
        results = anyio.run(bench, args, model, backend=args.backend)
    report(results, args, model)


if __name__ == "__main__":
    main()
