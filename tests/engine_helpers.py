"""Helpers shared by the engine tests: running requests and the transformers reference."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import anyio
import torch

from tgengine import Engine, EngineConfig, RequestOutput, SamplingParams

TIMEOUT = 60  # seconds: a bound on any single engine test; none should come close


def make_prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths (1..41); some share a 9-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(9)]
    prompts = []
    for i in range(count):
        length = [1, 5, 9, 13, 17, 24, 33, 41][i % 8]
        tail = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompts.append((shared + tail)[:length] if i % 2 else tail)
    return prompts


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(model_dir: Path | str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate``, greedy, EOS ignored: the reference tokens."""
    return hf_greedy_with_margin(model_dir, prompt, max_new_tokens)[0]


def hf_greedy_with_margin(
    model_dir: Path | str, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], float]:
    """``hf_greedy``'s tokens and the smallest top-1 logit margin along the way."""
    model = _hf_model(str(model_dir))
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = [float(s[0].topk(2).values.diff().abs()) for s in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), min(margins)


async def collect(
    engine: Engine, prompt: str | list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [chunk async for chunk in engine.generate(prompt, params)]


def tokens_of(chunks: list[RequestOutput]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def generate_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[RequestOutput]]:
    """Submit every prompt at once (continuous batching); chunks per prompt, in order.

    Admission is synchronous, so every request is waiting before the first step runs:
    the batch the scheduler sees does not depend on how the backend orders tasks.
    """
    results: list[list[RequestOutput]] = [[] for _ in prompts]
    streams = [engine.generate(prompt, params) for prompt in prompts]

    async def one(i: int) -> None:
        results[i] = [chunk async for chunk in streams[i]]

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tiny_config(model_dir: Path, **overrides: object) -> EngineConfig:
    options: dict[str, object] = {"dtype": "float32", "block_size": 4, "num_blocks": 256}
    options.update(overrides)
    return EngineConfig(model=str(model_dir), **options)  # type: ignore[arg-type]


class Consumer:
    """Consumes one request's stream in a task; events say when it started and ended."""

    def __init__(
        self,
        engine: Engine,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.chunks: list[RequestOutput] = []
        self.first_chunk = anyio.Event()
        self.done = anyio.Event()
        self.error: BaseException | None = None

    async def run(self) -> None:
        try:
            async for chunk in self.engine.generate(
                self.prompt, self.params, request_id=self.request_id
            ):
                self.chunks.append(chunk)
                self.first_chunk.set()
        except Exception as exc:  # admission errors are part of what tests check
            self.error = exc
        finally:
            self.first_chunk.set()
            self.done.set()

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason if self.chunks else None

    @property
    def token_ids(self) -> list[int]:
        return tokens_of(self.chunks)


def engine_threads() -> list[str]:
    """Names of threads currently executing tgengine code (there must be none after stop)."""
    import sys
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        f = frame
        while f is not None:
            if "/tgengine/" in f.f_code.co_filename.replace("\\", "/"):
                busy.append(names.get(ident, str(ident)))
                break
            f = f.f_back
    return busy


async def stream_all(tg: anyio.abc.TaskGroup, consumers: list[Consumer]) -> None:
    """Start every consumer in ``tg``; return once each has received its first chunk."""
    for c in consumers:
        tg.start_soon(c.run)
    for c in consumers:
        await c.first_chunk.wait()
