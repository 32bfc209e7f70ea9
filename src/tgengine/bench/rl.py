"""``bench rl``: the RL cycle of ``tgengine.examples.rl`` on a tiny model, many times over.

Each cycle (``RLLoop.cycle``): rollouts with log probabilities, sleep, one trainer step,
wake the weights, push them, wake the KV cache; timed per phase and bounded by
``fail_after``. Per cycle it records this process's RSS, ``engine.memory_stats()``, open
file descriptors and threads, and whether every chunk carried the weight version the
trainer's step implies. ``--process`` runs the engine in its own process under an
``EngineSupervisor``; ``--kill-at N`` then SIGKILLs it at the first chunk of cycle N (the
loop must see ``EngineDeadError``, wait for the restart and push its weights again).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from ..config import EngineConfig
from ..engine.client import EngineClient
from ..kernels.isa import isa
from ..sampling import SamplingParams
from .tables import isa_suffix

_MIB = 1024 * 1024

# A two-layer Llama: the cycle's cost is the lifecycle's, not the model's.
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.15,
}


def write_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """A random float32 ``TINY_LLAMA`` with the synthetic byte tokenizer, written once."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from .synthetic import _byte_tokenizer

    path = Path(path)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA), dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(path))
    _byte_tokenizer(path)
    return path


class KillDuringRollout:
    """An engine wrapper that SIGKILLs the engine process at the first chunk of rollout
    number ``at`` (counting ``generate`` calls in groups of ``per_rollout``).

    A planted fault for benches and tests, the way a test wraps a transport; it delegates
    everything else to ``engine`` (an ``EngineSupervisor`` or a ``ProcessEngine``).
    """

    def __init__(self, engine: Any, *, at: int, per_rollout: int) -> None:
        self._engine = engine
        self._calls = 0
        self._at = at * per_rollout
        self.killed_at: float | None = None
        self.killed_pid: int | None = None
        self.error_seen_at: float | None = None  # the first "error" chunk after the kill

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt: Any, params: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        stream = self._engine.generate(prompt, params, **kwargs)
        armed = self._calls == self._at and self.killed_at is None
        self._calls += 1
        return self._watch(stream, armed)

    async def _watch(self, stream: Any, armed: bool) -> AsyncIterator[Any]:
        async for chunk in stream:
            if armed and chunk.token_ids and self.killed_at is None:
                self.killed_pid = self._engine.pid
                self.killed_at = time.perf_counter()
                os.kill(self.killed_pid, signal.SIGKILL)
            if chunk.finish_reason == "error" and self.error_seen_at is None:
                self.error_seen_at = time.perf_counter()
            yield chunk


def _prompts(num_prompts: int, vocab: int) -> list[list[int]]:
    return [[3 + (7 * i + 11 * j) % (vocab - 3) for j in range(12 + i)] for i in range(num_prompts)]


def _even_reward(step: int, i: int, sample: Any) -> float:
    """The share of even token ids: something for the trainer to push up."""
    return sum(t % 2 == 0 for t in sample.token_ids) / max(1, len(sample.token_ids))


async def _bench(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from ..examples.rl import RLLoop, Trainer, process_counts
    from ..open_engine import open_engine
    from ..process.supervisor import EngineSupervisor, RestartPolicy

    # A small explicit cache: the default budget (512 MiB) is some 65,000 blocks of this
    # model, and sleep rebuilds the block pool in Python (about 1 s here at that size).
    config = EngineConfig(
        model=model_dir,
        dtype="float32",
        num_threads=args.threads,
        seed=args.seed,
        num_blocks=args.num_blocks,
    )
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=0, seed=args.seed
    )
    trainer = Trainer(model_dir, lr=args.lr, seed=args.seed)
    prompts = _prompts(args.prompts, int(TINY_LLAMA["vocab_size"]))
    rows: list[dict[str, Any]] = []
    full: list[dict[str, Any]] = []
    hangs = 0
    killer: KillDuringRollout | None = None
    progress = _bar(args)
    counts_before = process_counts()
    async with anyio.create_task_group() as tg:
        engine: Any
        if args.process:
            supervisor = EngineSupervisor(config, RestartPolicy(initial_backoff=0.0))
            await tg.start(supervisor.run)
            engine = supervisor
            if args.kill_at is not None:
                engine = killer = KillDuringRollout(
                    supervisor, at=args.kill_at, per_rollout=len(prompts)
                )
        else:
            engine = await tg.start(_in_process, config, open_engine)
        if not args.no_gc_freeze:
            # sleep() ends with gc.collect(); the ~370,000 objects that torch and
            # transformers left at start-up live for good, and collecting them took
            # ~0.8 s of every sleep here. Frozen, they are skipped.
            gc.freeze()
        loop = RLLoop(
            engine,
            trainer,
            lambda step: prompts,
            _even_reward,
            params,
            sleep_level=args.sleep_level,
            cycle_timeout=args.cycle_timeout,
        )
        try:
            async for stats in loop.cycles(args.cycles):
                rows.append(_row(stats, engine))
                if len(full) < 2 or trainer.step == args.cycles:
                    full.append(stats.as_dict())
                progress.update(1)
        except TimeoutError:
            hangs += 1
        finally:
            progress.close()
        engine.stop()
        tg.cancel_scope.cancel()  # the in-process engine's holder sleeps until cancelled
    result: dict[str, Any] = {
        "bench": "rl",
        "machine": {"isa": isa()},  # what every bench figure names (kernels.isa)
        "workload": {
            "cycles": args.cycles,
            "backend": args.backend,
            "process": args.process,
            "kill_at": args.kill_at,
            "sleep_level": args.sleep_level,
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "num_blocks": args.num_blocks,
            "gc_freeze": not args.no_gc_freeze,
            "cycle_timeout_s": args.cycle_timeout,
        },
        "model": model_dir,
        "hangs": hangs,
        "counts_before": counts_before,
        "rows": rows,
        "full_cycles": full,
        "summary": summarize(rows, args.cycles, hangs),
    }
    if killer is not None:
        seen, killed = killer.error_seen_at, killer.killed_at
        result["fault"] = {
            "killed_pid": killer.killed_pid,
            "restarts": loop.num_restarts,
            "kill_to_error_chunk_s": seen - killed if seen and killed else None,
            "restore_s": loop.restore_seconds,
        }
    return result


async def _in_process(config: EngineConfig, opener: Any, *, task_status: Any) -> None:
    async with opener(config) as engine:
        task_status.started(engine)
        await anyio.sleep_forever()


def _row(stats: Any, engine: EngineClient) -> dict[str, Any]:
    memory = stats.engine_memory.get("train", {})
    device: dict[str, Any] = next(iter(memory.values()), {})
    return {
        "step": stats.step,
        "seconds": stats.seconds,
        "cycle_s": sum(stats.seconds.values()),
        "rss_bytes": stats.rss_bytes,
        "engine_rss_bytes": device.get("rss_bytes", 0),
        "engine_weights_asleep_bytes": device.get("weights_bytes", 0),
        "open_fds": stats.counts["open_fds"],
        "threads": stats.counts["threads"],
        "os_threads": stats.counts["os_threads"],
        "mean_reward": stats.mean_reward,
        "weight_versions": stats.weight_versions,
        "expected_version": stats.expected_version,
        "versions_ok": stats.weight_versions == [stats.expected_version],
        "logprob_abs_diff_max": stats.train.logprob_abs_diff_max,
        "num_restarts": stats.num_restarts,
    }


def summarize(rows: list[dict[str, Any]], cycles: int, hangs: int) -> dict[str, Any]:
    """Per-phase medians, RSS drift after warm-up, fd/thread growth, versions, hangs."""
    if not rows:
        return {"cycles_done": 0, "hangs": hangs}
    phases = list(rows[0]["seconds"])
    warm = rows[min(len(rows) - 1, max(1, len(rows) // 10))]  # after 10 % of the run
    last = rows[-1]

    def end_rss(row: dict[str, Any]) -> int:
        return int(row["rss_bytes"]["wakeup kv_cache"])

    def drift(key: str, value: Any) -> dict[str, Any]:
        a, b = value(warm), value(last)
        return {f"{key}_warm": a, f"{key}_last": b, f"{key}_drift_pct": 100 * (b - a) / max(1, a)}

    return {
        "cycles_done": len(rows),
        "cycles_asked": cycles,
        "hangs": hangs,
        "median_s": {p: statistics.median(r["seconds"][p] for r in rows) for p in phases},
        "max_s": {p: max(r["seconds"][p] for r in rows) for p in phases},
        "cycle_median_s": statistics.median(r["cycle_s"] for r in rows),
        "cycle_max_s": max(r["cycle_s"] for r in rows),
        "warm_cycle": warm["step"],
        **drift("rss", end_rss),
        **drift("engine_rss", lambda r: int(r["engine_rss_bytes"])),
        "rss_first": end_rss(rows[0]),
        "open_fds": [rows[0]["open_fds"], warm["open_fds"], last["open_fds"]],
        "open_fds_max": max(r["open_fds"] for r in rows),
        "threads": [rows[0]["threads"], warm["threads"], last["threads"]],
        "os_threads": [rows[0]["os_threads"], warm["os_threads"], last["os_threads"]],
        "os_threads_max": max(r["os_threads"] for r in rows),
        "versions_ok": sum(r["versions_ok"] for r in rows),
        "versions_equal_step": sum(
            r["weight_versions"] == [r["step"] - 1] for r in rows
        ),  # at level 1 without restarts, version == the step the rollout used
        "reward_first": rows[0]["mean_reward"],
        "reward_last": last["mean_reward"],
        "logprob_abs_diff_max": max(r["logprob_abs_diff_max"] for r in rows),
        "restarts": last["num_restarts"],
    }


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    w = result["workload"]
    lines = [
        f"== bench rl{isa_suffix(result)} ==",
        "workload: " + ", ".join(f"{k}={v}" for k, v in w.items()),
        f"cycles: {s['cycles_done']} of {s.get('cycles_asked')}, hangs: {s['hangs']}, "
        f"engine restarts: {s.get('restarts', 0)}",
    ]
    fault = result.get("fault")
    if fault:
        to_error = fault["kill_to_error_chunk_s"]
        lines.append(
            f"SIGKILL of engine process {fault['killed_pid']}: the error chunk after "
            + (f"{to_error:.3f} s" if to_error is not None else "(none seen)")
            + ", restore (wait for the restart, re-push) "
            + ", ".join(f"{x:.2f} s" for x in fault["restore_s"])
        )
    if not s["cycles_done"]:
        return "\n".join(lines)
    lines += ["", f"{'phase':<18}{'median ms':>12}{'max ms':>12}"]
    for phase, median in s["median_s"].items():
        lines.append(f"{phase:<18}{1e3 * median:>12.1f}{1e3 * s['max_s'][phase]:>12.1f}")
    lines.append(f"{'cycle':<18}{1e3 * s['cycle_median_s']:>12.1f}{1e3 * s['cycle_max_s']:>12.1f}")
    lines += [
        "",
        f"RSS (this process) after cycle {s['warm_cycle']}: {s['rss_warm'] / _MIB:.1f} MiB, "
        f"last: {s['rss_last'] / _MIB:.1f} MiB, drift {s['rss_drift_pct']:+.2f} %",
    ]
    if w["process"]:
        lines.append(
            f"RSS (engine process): {s['engine_rss_warm'] / _MIB:.1f} -> "
            f"{s['engine_rss_last'] / _MIB:.1f} MiB, drift {s['engine_rss_drift_pct']:+.2f} %"
        )
    lines += [
        f"open fds first/warm/last: {s['open_fds']} (max {s['open_fds_max']}); "
        f"threads (Python) {s['threads']}; OS threads {s['os_threads']} "
        f"(max {s['os_threads_max']})",
        f"cycles whose every chunk had the expected weight_version: {s['versions_ok']} of "
        f"{s['cycles_done']}; version == trainer step: {s['versions_equal_step']}",
        f"reward first/last: {s['reward_first']:.3f} / {s['reward_last']:.3f}; "
        f"max |trainer - engine| logprob: {s['logprob_abs_diff_max']:.2e}",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for phase in rows[0]["seconds"] if rows else []:
        axes[0][0].plot(steps, [1e3 * r["seconds"][phase] for r in rows], label=phase, lw=0.8)
    axes[0][0].set_ylabel("ms")
    axes[0][0].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    axes[0][1].plot(steps, [r["rss_bytes"]["wakeup kv_cache"] / _MIB for r in rows], label="this")
    if result["workload"]["process"]:
        axes[0][1].plot(steps, [r["engine_rss_bytes"] / _MIB for r in rows], label="engine")
    axes[0][1].set_ylabel("RSS after the cycle (MiB)")
    axes[0][1].legend()
    axes[1][0].plot(steps, [r["open_fds"] for r in rows], label="open fds")
    axes[1][0].plot(steps, [r["os_threads"] for r in rows], label="OS threads")
    axes[1][0].legend()
    axes[1][1].plot(steps, [r["mean_reward"] for r in rows], lw=0.8)
    axes[1][1].set_ylabel("mean reward")
    for ax in axes[1]:
        ax.set_xlabel("cycle (trainer step)")
    fig.suptitle(f"tgengine bench rl{isa_suffix(result)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _bar(args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    return tqdm(total=args.cycles, desc="rl cycles", disable=args.no_progress, mininterval=2)


def add_parser(benches: Any) -> None:
    """Register ``bench rl`` (its own options and handler)."""
    p = benches.add_parser("rl", help="the RL cycle (rollout, sleep, train, wake, push), timed")
    p.add_argument("--model", metavar="DIR", help="default: a tiny random Llama (written once)")
    p.add_argument("--cycles", type=int, help="default: 100 (quick: 3)")
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--process", action="store_true", help="the engine in its own process")
    p.add_argument("--kill-at", type=int, metavar="N", help="with --process: SIGKILL in cycle N")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-blocks", type=int, default=128, help="KV cache blocks (default: 128)")
    p.add_argument("--threads", type=int, default=1, help="engine threads (default: 1)")
    p.add_argument("--cycle-timeout", type=float, default=60.0, help="fail_after per cycle (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="DIR", help="write rl.json, rl.txt and rl.png here")
    p.add_argument("--no-gc-freeze", action="store_true", help="skip gc.freeze() at start")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from ..runtime.disk_cache import cache_root

    if args.kill_at is not None and not args.process:
        raise SystemExit("bench rl: --kill-at needs --process")
    if args.cycles is None:
        args.cycles = 3 if args.quick else 100
    model_dir = args.model or str(write_tiny_model(cache_root() / "bench-rl-tiny-llama"))
    result = anyio.run(_bench, args, model_dir, backend=args.backend)
    print(render(result), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rl.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (out / "rl.txt").write_text(render(result) + "\n")
        written = [out / "rl.json", out / "rl.txt"]
        if plot(result, out / "rl.png"):
            written.append(out / "rl.png")
        print("wrote " + ", ".join(str(p) for p in written))
    return 1 if result["hangs"] else 0
