"""``python examples/rl/train.py``: GRPO on SmolLM2-135M-Instruct with tgengine colocated.

The trainer (transformers + AdamW) and the engine share this process (or, with
``--process``, the engine runs in its own, under a supervisor that restarts it). Writes
``rl.json`` and ``rl.png`` (reward and log-probability drift per step) into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from ... import EngineConfig, SamplingParams, open_engine
from ...engine.client import EngineClient
from .grpo import Sample, Trainer
from .loop import CycleStats, RLLoop
from .task import NumberPrompt, make_prompts, number_reward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/rl/train.py", description=__doc__)
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    p.add_argument("--steps", type=int, default=30, help="trainer steps = cycles (default: 30)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per cycle (default: 4)")
    p.add_argument("--num-prompts", type=int, default=16, help="the task's prompt pool")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default: 4)")
    p.add_argument("--max-tokens", type=int, default=10, help="per sample (default: 10)")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW (default: 5e-5)")
    p.add_argument("--train-layers", type=int, default=6, help="last N layers trained; 0: all")
    p.add_argument("--epochs", type=int, default=1, help="passes per step (2: KL measured)")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], default=1)
    p.add_argument("--process", action="store_true", help="the engine in its own process")
    p.add_argument("--threads", type=int, help="the engine's CPU threads (default: measured)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="rl-out", help="where rl.json and rl.png go")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


async def train(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from ...process.supervisor import EngineSupervisor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool: list[NumberPrompt] = make_prompts(args.num_prompts, seed=args.seed)
    pool_ids = [chat_ids(tokenizer, p.text) for p in pool]

    def prompts(step: int) -> list[list[int]]:
        return [pool_ids[(step * args.prompts + i) % len(pool)] for i in range(args.prompts)]

    def reward(step: int, i: int, sample: Sample) -> float:
        prompt = pool[(step * args.prompts + i) % len(pool)]
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        return number_reward(prompt, str(text))

    config = EngineConfig(
        model=model_dir, dtype="float32", seed=args.seed, num_threads=args.threads
    )
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=0, seed=args.seed
    )
    trainer = Trainer(
        model_dir,
        lr=args.lr,
        train_layers=args.train_layers or None,
        epochs=args.epochs,
        seed=args.seed,
    )
    rows: list[CycleStats] = []
    async with anyio.create_task_group() as tg:
        engine: EngineClient
        if args.process:
            supervisor = EngineSupervisor(config)
            await tg.start(supervisor.run)
            engine = supervisor
        else:
            engine = await tg.start(_in_process, config)
        gc.freeze()  # start-up's objects live for good: sleep()'s gc.collect() skips them
        loop = RLLoop(engine, trainer, prompts, reward, params, sleep_level=args.sleep_level)
        bar = _bar(args)
        try:
            async for stats in loop.cycles(args.steps):
                rows.append(stats)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{stats.mean_reward:.2f}",
                    dlogp=f"{stats.train.logprob_abs_diff_mean:.1e}",
                )
            final = await loop.evaluate()
        finally:
            bar.close()
        engine.stop()
        tg.cancel_scope.cancel()  # the in-process engine's holder sleeps until cancelled
    return {"args": vars(args), "cycles": [r.as_dict() for r in rows], "final": final}


async def _in_process(config: EngineConfig, *, task_status: Any) -> None:
    async with open_engine(config) as engine:
        task_status.started(engine)
        await anyio.sleep_forever()


def _bar(args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    return tqdm(total=args.steps, desc="GRPO steps", disable=args.no_progress, file=sys.stderr)


def plot(result: dict[str, Any], path: Path) -> None:
    """Mean reward, and the log-probability drift and mismatch, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = result["cycles"]
    steps = [c["step"] - 1 for c in cycles]  # the weights each cycle's rollouts used
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].plot(steps, [c["mean_reward"] for c in cycles], marker="o", label="mean reward")
    axes[0].axhline(
        result["final"]["mean_reward"],
        color="tab:green",
        ls="--",
        label=f"after {len(cycles)} steps (a fresh draw)",
    )
    axes[0].set_xlabel("trainer step of the rollout's weights")
    axes[0].set_ylabel("reward (0..1)")
    axes[0].legend()
    axes[1].plot(
        steps,
        [c["engine_logprob_mean"] for c in cycles],
        marker="o",
        label="mean logprob of sampled tokens (engine)",
    )
    ax2 = axes[1].twinx()
    ax2.semilogy(
        steps,
        [max(1e-9, c["train"]["logprob_abs_diff_mean"]) for c in cycles],
        color="tab:red",
        marker="x",
        label="|trainer - engine| logprob, mean",
    )
    axes[1].set_xlabel("trainer step of the rollout's weights")
    axes[1].set_ylabel("nats / token")
    ax2.set_ylabel("|trainer - engine| (nats)")
    axes[1].legend(loc="upper left")
    ax2.legend(loc="lower right")
    fig.suptitle("tgengine examples.rl: GRPO, number-in-range task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(result: dict[str, Any]) -> str:
    cycles = result["cycles"]
    first, last5 = cycles[0], cycles[-5:]
    diffs = [c["train"]["logprob_abs_diff_max"] for c in cycles]
    means = [c["train"]["logprob_abs_diff_mean"] for c in cycles]
    versions_ok = all(c["weight_versions"] == [c["expected_version"]] for c in cycles)
    return "\n".join(
        [
            f"reward at step 0: {first['mean_reward']:.3f}; mean of the last 5 cycles: "
            f"{sum(c['mean_reward'] for c in last5) / len(last5):.3f}; after "
            f"{cycles[-1]['step']} steps (fresh draw): {result['final']['mean_reward']:.3f}",
            f"|trainer - engine| logprob of the sampled tokens: mean {sum(means) / len(means):.2e},"
            f" max {max(diffs):.2e} (float32 both)",
            f"every chunk's weight_version as expected: {versions_ok}; engine restarts: "
            f"{cycles[-1]['num_restarts']}",
        ]
    )


def main(argv: list[str] | None = None, *, default_model: str | None = None) -> int:
    """Run the loop; ``default_model`` is the directory used without ``--model`` (the
    script at ``examples/rl/train.py`` passes the CLI's default model)."""
    args = parse_args(argv)
    model_dir = args.model or default_model
    if model_dir is None:
        raise SystemExit("--model DIR is needed (examples/rl/train.py finds the default)")
    result = anyio.run(train, args, model_dir, backend=args.backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    plot(result, out / "rl.png")
    print(summary(result))
    print(f"wrote {out / 'rl.json'} and {out / 'rl.png'}")
    return 0
