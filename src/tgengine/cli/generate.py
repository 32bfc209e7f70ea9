"""``python -m tgengine generate PROMPT``: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import anyio

from ..config import EngineConfig
from ..engine.engine import Engine
from ..errors import TGEngineError
from ..sampling import SamplingParams
from ..state import EngineState
from ..tokenization.tokenizer import chat_prompt
from .common import add_engine_options, engine_config, fail
from .signals import stop_on_signals


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "generate",
        help="stream a completion for PROMPT to the terminal",
        description="Stream a completion for PROMPT. SIGINT/SIGTERM stop gracefully "
        "(--grace seconds for the request to finish); a second signal stops at once.",
    )
    parser.add_argument("prompt", help="the prompt text")
    add_engine_options(parser)
    parser.add_argument(
        "--chat", action="store_true", help="wrap PROMPT as a user message in the chat template"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--seed", type=int, help="makes sampling reproducible")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-text token"
    )
    parser.add_argument(
        "--grace", type=float, default=2.0, help="seconds to finish after a signal (%(default)s)"
    )
    parser.set_defaults(handler=run)


def configs(args: argparse.Namespace) -> tuple[EngineConfig, SamplingParams]:
    """The engine's configuration and the request's parameters, from the parsed options."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    return engine_config(args), params


def run(args: argparse.Namespace) -> int:
    try:
        config, params = configs(args)
        anyio.run(partial(_generate, config, args, params), backend=args.backend)
    except TGEngineError as exc:
        return fail(exc)
    return 0


async def _generate(config: EngineConfig, args: argparse.Namespace, params: SamplingParams) -> None:
    engine = Engine(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, engine, tg.cancel_scope, args.grace)
            await tg.start(engine.run)
            prompt = args.prompt
            if args.chat:
                prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": prompt}])
            if engine.state is EngineState.RUNNING:  # not stopped by a signal while loading
                await _stream(engine, prompt, params)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise


async def _stream(engine: Engine, prompt: str | list[int], params: SamplingParams) -> None:
    start = time.perf_counter()
    first: float | None = None
    num_tokens = 0
    reason = None
    async for chunk in engine.generate(prompt, params):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        num_tokens += len(chunk.token_ids)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        reason = chunk.finish_reason
    elapsed = time.perf_counter() - start
    decode = elapsed - ((first or start) - start)
    rate = (num_tokens - 1) / decode if num_tokens > 1 and decode > 0 else 0.0
    print(file=sys.stdout)
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s, first token {((first or start) - start):.3f} s, "
        f"decode {rate:.1f} tokens/s, finish_reason={reason}]",
        file=sys.stderr,
    )
