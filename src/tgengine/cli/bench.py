"""``python -m tgengine bench throughput | latency | lifecycle | weights | batch32 | parity | ...``.

(and ``rl``, registered from ``tgengine.bench.rl`` with its own options and report.)
Each subcommand runs one bench (``tgengine.bench``) in this process, prints its table, and
with ``--out DIR`` writes ``<bench>.json``, ``<bench>.txt`` and ``<bench>.png`` there.
``--quick`` shrinks every size so that a run on a tiny model takes seconds (tests, smoke
runs); its numbers mean nothing. ``throughput`` and ``latency`` take ``--peer`` (vLLM CPU,
llama.cpp; ``tgengine.bench.peers``), each run in its own environment after tgengine;
``memory`` takes ``--peer vllm=PYTHON``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TGEngineError
from .bench_types import (
    SYSTEMS,
    at_least_one,
    int_list,
    peer_spec,
    peer_thread_counts,
    system_list,
    thread_count,
)
from .common import fail, resolve_model


def _peer_options(parser: argparse.ArgumentParser, *, memory: bool = False) -> None:
    """``--peer`` and its options; ``memory``: for ``bench memory`` (vLLM only, no
    ``--tgengine-threads``, peers at ``--threads`` unless ``--peer-threads`` says more)."""
    if not memory:
        parser.add_argument(
            "--tgengine-threads",
            type=int_list,
            default=(),
            metavar="N,N",
            help="run tgengine once per thread count (rows 'tgengine t=N'); its best run is "
            "compared (default: once, at --threads)",
        )
    group = parser.add_argument_group(
        "peers", "other engines, each in its own environment, run after tgengine on the same work"
    )
    group.add_argument(
        "--peer",
        type=peer_spec,
        action="append",
        default=[],
        metavar="KIND=PATH",
        help="vllm=PYTHON (the python of vLLM's environment)"
        + ("" if memory else ", llamacpp=LLAMA_SERVER or llamacpp=LLAMA_SERVER,GGUF; repeatable"),
    )
    if not memory:
        group.add_argument("--peer-gguf", metavar="FILE", help="the GGUF llama.cpp serves")
    group.add_argument(
        "--peer-threads",
        type=peer_thread_counts,
        default=None if memory else (1, 2),
        metavar="N,N",
        help="thread counts every peer runs at ('default': its own)"
        + ("(default: --threads)" if memory else "; the best one is compared (default: 1,2)"),
    )
    group.add_argument(
        "--peer-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="longest one peer run may take, start-up included (default: %(default)s)",
    )
    group.add_argument("--peer-logs", metavar="DIR", help="keep each peer's log here")


def _peer_plan(args: argparse.Namespace) -> Any:
    """The ``PeerPlan`` of ``--peer*``; raises ``PeerSpecError`` for a missing file."""
    from ..bench.peers import PeerPlan, with_gguf

    peers = with_gguf(args.peer, getattr(args, "peer_gguf", None))
    for peer in peers:
        peer.check()
    if args.peer_logs:
        Path(args.peer_logs).mkdir(parents=True, exist_ok=True)
    return PeerPlan(tuple(peers), args.peer_threads, args.peer_timeout, args.peer_logs)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV cache, every system (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N or auto = cuda when present (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=thread_count,
        default="auto",
        help="CPU threads for every system; auto = the fastest for a GEMM here "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        metavar="BYTES",
        help="tgengine's KV cache budget (default: the engine's)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="tgengine's ranks (default: %(default)s)",
    )
    parser.add_argument(
        "--executor",
        choices=["uni", "mp", "ray"],
        help="what runs tgengine's ranks (default: uni at size 1, mp above); with "
        "'--executor mp' at size 1, throughput and latency also run uni and report the "
        "control plane's cost per step",
    )
    parser.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster (--executor ray)")
    parser.add_argument(
        "--quantization",
        choices=["int8"],
        help="tgengine's weights as int8 (EngineConfig.quantization; its memory floor counts "
        "a byte per matrix weight); default: none",
    )
    parser.add_argument("--out", metavar="DIR", help="write JSON, text and a PNG chart here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and short measurements, for tests and smoke runs",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmark tgengine against transformers and the machine's limits",
        description="Benchmarks; each prints a table and, with --out, writes JSON and a PNG.",
    )
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")

    p = benches.add_parser(
        "throughput", help="mixed workload: tgengine vs generate vs generate_batch"
    )
    _common(p)
    p.add_argument("--num-requests", type=int, help="default: 64 (quick: 6)")
    p.add_argument(
        "--scale",
        type=float,
        help="multiply prompt lengths (16-512) and max_tokens (16-256) by this "
        "(default: 1; quick: 0.05)",
    )
    p.add_argument(
        "--batch-sizes", type=int_list, help="static generate batch sizes (default: 8,16,32)"
    )
    p.add_argument("--systems", type=system_list, default=SYSTEMS, help="default: %(default)s")
    _peer_options(p)
    p.set_defaults(handler=run, runner=_throughput)

    p = benches.add_parser("latency", help="single-stream TTFT and decode rate; N streams")
    _common(p)
    p.add_argument("--prompt-lens", type=int_list, help="default: 16,256,1024")
    p.add_argument("--max-tokens", type=int, help="tokens per stream (default: 64)")
    p.add_argument("--concurrency", type=at_least_one, help="concurrent streams (default: 8)")
    p.add_argument("--repeats", type=int, help="single-stream runs; the median counts (default: 3)")
    p.add_argument(
        "--systems", type=system_list, default="tgengine,hf_generate", help="default: %(default)s"
    )
    _peer_options(p)
    p.set_defaults(handler=run, runner=_latency)

    p = benches.add_parser("lifecycle", help="stop/pause/sleep/wakeup times, memory, RSS drift")
    _common(p)
    p.add_argument("--num-running", type=int, help="requests in flight (default: 16)")
    p.add_argument("--cycles", type=int, help="sleep/wakeup cycles for RSS drift (default: 20)")
    p.add_argument(
        "--drift-level",
        type=int,
        choices=[1, 2],
        default=1,
        help="sleep level of the drift cycles (default: %(default)s)",
    )
    p.set_defaults(handler=run, runner=_lifecycle)

    from ..bench.weights import add_parser as add_weights  # its options, and _common's

    add_weights(benches, _common, run)
    from ..bench.threads import add_parser as add_threads

    add_threads(benches, _common, run)

    p = benches.add_parser("parity", help="greedy tokens vs transformers generate (any device)")
    _common(p)
    p.add_argument("--max-tokens", type=int, help="tokens per prompt (default: 32)")
    p.set_defaults(handler=run, runner=_parity)

    p = benches.add_parser("summary", help="one table from the JSON results in DIR")
    p.add_argument("dir", metavar="DIR", help="a directory written by --out")
    p.set_defaults(handler=_summary)

    p = benches.add_parser("batch32", help="one request, then 32 at once, vs generate bs 1 / 32")
    _common(p)
    p.add_argument("--num-requests", type=int, help="default: 32")
    p.add_argument("--prompt-len", type=int, help="default: 64")
    p.add_argument("--max-tokens", type=int, help="default: 64")
    p.add_argument(
        "--systems", type=system_list, default="tgengine,hf_generate", help="default: %(default)s"
    )
    p.set_defaults(handler=run, runner=_batch32)

    p = benches.add_parser(
        "structured", help="structured outputs: the grammar's share of a decode step, compiles"
    )
    _common(p)
    p.add_argument("--num-requests", type=int, help="all constrained (default: 32)")
    p.add_argument("--prompt-len", type=int, help="default: 32")
    p.add_argument("--max-tokens", type=int, help="default: 32")
    p.set_defaults(handler=run, runner=_structured)
    p = benches.add_parser(
        "startup", help="time to the first token of `python -m tgengine generate`, warm"
    )
    _common(p)
    p.add_argument("--runs", type=int, help="fresh processes timed (default: 3; quick: 1)")
    p.add_argument("--max-tokens", type=int, help="default: 8")
    p.set_defaults(handler=run, runner=_startup)

    p = benches.add_parser(
        "step", help="a step's time split (products, attention, rest, sampling, engine) vs floor"
    )
    _common(p)
    p.add_argument("--num-seqs", type=int, help="requests at once (default: 32; quick: 4)")
    p.add_argument(
        "--prompt-lens", type=int_list, help="prompt lengths lo,hi (default: 300,430; quick: 8,24)"
    )
    p.add_argument("--max-tokens", type=int, help="tokens each (default: 32; quick: 6)")
    p.add_argument(
        "--no-prepack",
        action="store_true",
        help="tgengine's weights plain (EngineConfig.prepack_weights=False): the products "
        "through torch, as oneDNN-packed ones run on AVX-512",
    )
    p.set_defaults(handler=run, runner=_step)

    p = benches.add_parser("memory", help="host memory of a synthetic 1B Llama: load, steady")
    _common(p)
    p.add_argument(
        "--model-dir",
        metavar="DIR",
        help="where the synthetic model is written once (default: the cache dir)",
    )
    p.add_argument("--systems", default="tgengine,transformers", help="default: %(default)s")
    p.add_argument("--decode-tokens", type=int, help="tokens per request (default: 16)")
    _peer_options(p, memory=True)
    p.set_defaults(handler=run, runner=_memory)

    from ..bench.rl import add_parser as add_rl  # its own options and report

    add_rl(benches)


def _pick(value: Any, normal: Any, quick: Any, args: argparse.Namespace) -> Any:
    if value is not None:
        return value
    return quick if args.quick else normal


def _throughput(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.throughput import run_throughput
    from ..bench.workload import WorkloadSpec

    spec = WorkloadSpec(num_requests=_pick(args.num_requests, 64, 6, args), seed=args.seed)
    spec = spec.scaled(_pick(args.scale, 1.0, 0.05, args))
    batch_sizes = _pick(args.batch_sizes, (8, 16, 32), (2, 4), args)
    return run_throughput(
        setup,
        spec,
        batch_sizes=batch_sizes,
        systems=args.systems,
        peers=_peer_plan(args),
        tgengine_threads=args.tgengine_threads,
    )


def _latency(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.latency import run_latency

    return run_latency(
        setup,
        prompt_lens=_pick(args.prompt_lens, (16, 256, 1024), (4, 16, 64), args),
        max_tokens=_pick(args.max_tokens, 64, 6, args),
        concurrency=_pick(args.concurrency, 8, 3, args),
        concurrent_prompt_len=16 if args.quick else 256,
        repeats=_pick(args.repeats, 3, 1, args),
        seed=args.seed,
        systems=args.systems,
        peers=_peer_plan(args),
        tgengine_threads=args.tgengine_threads,
    )


def _lifecycle(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.lifecycle import run_lifecycle

    return run_lifecycle(
        setup,
        num_running=_pick(args.num_running, 16, 4, args),
        cycles=_pick(args.cycles, 20, 2, args),
        drift_level=args.drift_level,
    )


def _batch32(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.throughput import run_batch32

    return run_batch32(
        setup,
        num_requests=_pick(args.num_requests, 32, 4, args),
        prompt_len=_pick(args.prompt_len, 64, 8, args),
        max_tokens=_pick(args.max_tokens, 64, 6, args),
        seed=args.seed,
        systems=args.systems,
    )


def _structured(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.structured import run_structured

    return run_structured(
        setup,
        num_requests=_pick(args.num_requests, 32, 4, args),
        prompt_len=_pick(args.prompt_len, 32, 8, args),
        max_tokens=_pick(args.max_tokens, 32, 6, args),
        seed=args.seed,
    )


def _step(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    from ..bench.step_split import run_step_split

    if args.no_prepack:
        setup = replace(setup, prepack_weights=False)
    lens = _pick(args.prompt_lens, (300, 430), (8, 24), args)
    return run_step_split(
        setup,
        num_seqs=_pick(args.num_seqs, 32, 4, args),
        prompt_len=(lens[0], lens[-1]),
        max_tokens=_pick(args.max_tokens, 32, 6, args),
        seed=args.seed,
    )


def _memory(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    from ..bench.memory import LLAMA_1B, run_memory, write_synthetic_1b
    from ..bench.peers import DEFAULT_THREADS, PeerSpecError
    from ..runtime.disk_cache import cache_root

    if any(p.kind != "vllm" for p in args.peer):
        raise PeerSpecError("bench memory: only vllm peers (llama.cpp needs a GGUF of the model)")
    plan = _peer_plan(args)
    if args.peer_threads is None:
        plan = replace(plan, threads=(setup.threads or DEFAULT_THREADS,))

    shape = dict(LLAMA_1B)
    if args.quick:  # a few MB with the same structure, for tests
        shape |= {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128}
        shape |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        shape |= {"head_dim": 16}
    name = "synthetic-llama-1b" + ("-quick" if args.quick else "")
    model_dir = Path(args.model_dir) if args.model_dir else cache_root() / name
    write_synthetic_1b(model_dir, shape)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    return run_memory(
        setup,
        model_dir=model_dir,
        systems=systems,
        decode_tokens=_pick(args.decode_tokens, 16, 4, args),
        peers=plan,
    )


def _startup(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.startup import run_startup

    pinned = args.threads not in (None, "auto")  # auto: the engine measures, as by default
    return run_startup(
        setup,
        runs=_pick(args.runs, 3, 1, args),
        max_tokens=_pick(args.max_tokens, 8, 2, args),
        threads=setup.threads if pinned else None,
    )


def _parity(setup: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ..bench.parity import run_parity

    return run_parity(
        setup,
        prompt_lens=(3, 9, 20) if args.quick else (5, 17, 64, 200),
        max_tokens=_pick(args.max_tokens, 32, 6, args),
        seed=args.seed,
    )


def _summary(args: argparse.Namespace) -> int:
    from ..bench.summary import summarize_dir

    print(summarize_dir(args.dir))
    return 0


def run(args: argparse.Namespace) -> int:
    from ..bench.common import BenchSetup
    from ..bench.peers import PeerSpecError
    from ..bench.report import render, save
    from ..bench.throughput import with_machine

    runner: Callable[[Any, argparse.Namespace], dict[str, Any]] = args.runner
    try:
        setup = BenchSetup.resolve(
            resolve_model(args.model),
            args.dtype,
            args.device,
            args.threads,
            progress=not args.no_progress,
            kv_cache_memory=args.kv_cache_memory,
            quick=args.quick,
            tensor_parallel_size=args.tensor_parallel_size,
            executor=args.executor,
            ray_address=args.ray_address,
            quantization=args.quantization,
        )
        result = with_machine(setup, runner(setup, args))
    except (TGEngineError, PeerSpecError) as exc:
        return fail(exc)
    print(render(result), flush=True)
    if args.out:
        paths = save(result, args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0
