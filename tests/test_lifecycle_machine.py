"""A hypothesis state machine over a real tiny model: the lifecycle as a complete oracle.

Rules drive every lifecycle call and fault (generate, break off, cancel, abort, pause,
resume, sleep (``keep`` included), wakeup, update_weights valid and invalid (with either
``kept_kv``), updates in parts (``weight_update()``), stop with a grace, a step that
raises or hangs, one request's cache error, one constrained request's grammar rejecting
it), on asyncio and on trio; requests may carry structured outputs or ask for log
probabilities. A model (``lifecycle_model``) says how every request must end and what the
engine's state must be; after every rule the machine checks the state, the memory, the
block accounting and the counters, and checks each ended request against its model: its
finish reason, its error, its tokens against transformers' greedy reference for the
weights it ran on (under its constraint, if any), its streamed text against one decoding
of its tokens, and its log probabilities against transformers' (``lifecycle_sampling``).
A few scenario rules make fixed
sequences that random draws seldom reach (a level-2 sleep/wakeup cycle, a stop while a
request is held, an update after a request cached its prefixes); their sub-steps draw
nothing, so a derandomized run stays repeatable.

``TGENGINE_HYPOTHESIS_EXAMPLES`` (default 10 per backend) and ``TGENGINE_HYPOTHESIS_STEPS``
(default 25) give longer runs; ``TGENGINE_HYPOTHESIS_DERANDOMIZE=1`` makes a run repeatable
(the same examples every time, no example database), as mutation testing needs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from safetensors.torch import save_file

from tgengine import (
    EngineDeadError,
    EngineSleepingError,
    EngineState,
    IllegalStateError,
    InvalidRequestError,
    ModelLoadError,
    SamplingParams,
    kernels,
)
from tgengine.agent.agent import CPU_KV_CACHE_BYTES
from tgengine.errors import WorkerFailed
from tgengine.ipc.weights_file import (
    map_weights,
    new_weights_dir,
    remove_weights_dir,
    write_weights_file,
)
from tgengine.models.gemm import can_pack_panels

from engine_helpers import engine_threads, hf_greedy, hf_greedy_with_margin, tiny_config
from fault_injection import FaultInjector
from lifecycle_driver import (
    BOUND,
    EngineDriver,
    checker_problems,
    make_engine,
    mp_executor_exists,
    read_dir_weights,
)
from lifecycle_model import (
    EngineModel,
    RequestModel,
    cache_error_text,
    check_outcome,
    death_error_text,
)
from lifecycle_sampling import (
    CONSTRAINTS,
    LOGPROBS,
    PROMPT_LOGPROBS,
    TOLERANCE,
    LogprobReference,
    check_sampling,
    constrained_greedy,
    eos_ids,
    grammar_error_text,
    logprob_reference,
    reject_grammar,
    sampled_reference,
)
from process_helpers import child_pids
from structured_helpers import CASES

S = EngineState
T = TypeVar("T")

MAX_TOKENS = 32
# seconds: a tiny model's step takes milliseconds, but a loaded machine may stall one for
# long; the hang rule lowers it to HANG_TIMEOUT just before its step hangs
STEP_TIMEOUT = BOUND
HANG_TIMEOUT = 1.0
# Few blocks (block_size 4; a request needs up to 12 at max_model_len): requests preempt each
# other, and freed blocks, cached prefixes included, are soon reused for other content.
NUM_BLOCKS = 12
MAX_MODEL_LEN = 48  # below the longest prompt + MAX_TOKENS (25 + 32)
PROMPTS = [
    [5, 17, 42, 99],
    list(range(40, 62)),
    [*range(40, 54), 7, 8, 9],  # shares three full blocks (block_size 4) with the last
    [*range(40, 62), 11, 12, 13],  # extends the second prompt
    [3, 3, 3, 3, 3, 3, 3, 3, 3, 9],
    [100, 200, 300],
]
# Prompts that share no prefix with another: their requests always ask for log probabilities
# of their tokens and their prompt (which bypasses the prefix cache; these lose nothing).
LOGPROB_PROMPTS = (0, 5)
EXAMPLES = int(os.environ.get("TGENGINE_HYPOTHESIS_EXAMPLES", "10"))
# every layer attends to the last WINDOW keys only: a request's blocks behind it go back to
# the pool while it runs (a prompt of 22 tokens already leaves 3 blocks behind)
WINDOW = 8
# with the engine, or its model, in another process: each engine started costs a process.
# NB: hypothesis's first example is always its simplest (here: 25 calls of ``resume``, the
# first rule without arguments), which drives no request: so on these kinds every example
# starts with two requests (``start_engine``); each further example costs seconds per engine.
PROCESS_EXAMPLES = int(os.environ.get("TGENGINE_HYPOTHESIS_PROCESS_EXAMPLES", "1"))
# the sliding-window model's run (uni kind): its first example is that simplest one too
WINDOW_EXAMPLES = int(os.environ.get("TGENGINE_HYPOTHESIS_WINDOW_EXAMPLES", "2"))
STEPS = int(os.environ.get("TGENGINE_HYPOTHESIS_STEPS", "25"))
# the int8 start: a greedy request of this prompt, checked against transformers on the
# dequantized weights, whose top-1 logit must lead by INT8_MARGIN at every token (its
# steps run in bfloat16: their log probabilities came within 0.03 of float32's)
INT8_PROMPT = 5
INT8_TOKENS = 8
INT8_MARGIN = 0.05
INT8_TOLERANCE = 0.1
DERANDOMIZE = os.environ.get("TGENGINE_HYPOTHESIS_DERANDOMIZE") == "1"
# the split-prompt start: a budget of SPLIT_BUDGET tokens per step splits this prompt's
# prefill (22 tokens) over three steps; its greedy request holds EOS back for
# SPLIT_MIN_TOKENS tokens
SPLIT_PROMPT = 1
SPLIT_BUDGET = 8
SPLIT_MIN_TOKENS = 3


# name: (method, its arguments, the field InvalidRequestError must name, and its bad value)
INVALID_CALLS: dict[str, tuple[str, tuple[Any, ...], str, Any]] = {
    "pause mode": ("pause", ("bogus",), "mode", "bogus"),
    "sleep level": ("sleep", (3,), "level", 3),
    "sleep mode": ("sleep", (1, "bogus"), "mode", "bogus"),
    "wakeup no tag": ("wakeup", ([],), "tags", None),
    "wakeup unknown tag": ("wakeup", (["bogus"],), "tags", None),
    "abort unknown id": ("abort", (), "", None),
}


# an invalid tensor in place of ``(name, good)``: the tensor, and how the error names it
INVALID_WEIGHTS: dict[str, Callable[[str, torch.Tensor], tuple[tuple[str, Any], str]]] = {
    "wrong shape": lambda name, good: ((name, torch.zeros(3)), f"{name}: shape (3,)"),
    "wrong dtype": lambda name, good: ((name, good.long()), f"{name}: dtype torch.int64"),
    "unknown name": lambda name, good: (("no.such", good), "unknown tensor name 'no.such'"),
}


# starts that must be refused: the configuration, and the start of the reason
REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "kv budget": (
        {"num_blocks": None, "kv_cache_memory": 1},
        "KV cache budget of 1 bytes is below one block (",
    ),
    "quantized float32": (  # int8 panels quantize bf16/fp16 weights only
        {"quantization": "int8"},
        "quantization='int8' runs bfloat16/float16 models on a CPU with AVX2",
    ),
}


class Boom(RuntimeError):
    pass


def admission_error(engine: Any) -> Exception | None:
    """What ``generate`` would raise now, asked without admitting anything."""
    try:
        engine.check_admission()
    except Exception as exc:
        return exc
    return None


async def engine_run_error(engine: Any) -> Exception | None:
    """What a second ``run()`` raises."""
    try:
        await engine.run()
    except Exception as exc:
        return exc
    return None


class Computed(dict[Any, Any]):
    """A table whose entries are computed on first use (``compute(key)``), then kept: a run
    computes the references of the prompts and constraints it uses, not of all of them."""

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, key: Any) -> Any:
        value = self[key] = self.compute(key)
        return value


@functools.lru_cache(maxsize=2)
def reference(dir_a: str, dir_b: str) -> dict[str, dict[Any, list[int] | None]]:
    """transformers' greedy tokens of every prompt, for weight set A (on disk) and B; under
    each constraint, keyed ``(prompt, constraint)``; sampled with a seed at a temperature,
    keyed ``(prompt, seed, temperature)`` (None: a near-tie, no reference)."""

    def greedy(model_dir: str, key: Any) -> list[int] | None:
        if isinstance(key, tuple) and len(key) == 3:
            prompt, seed, temperature = key
            return sampled_reference(model_dir, PROMPTS[prompt], seed, temperature, MAX_TOKENS)
        if isinstance(key, tuple):
            prompt, kind = key
            return constrained_greedy(model_dir, PROMPTS[prompt], kind, MAX_TOKENS)
        return hf_greedy(model_dir, PROMPTS[key], MAX_TOKENS)

    return {w: Computed(functools.partial(greedy, d)) for w, d in {"A": dir_a, "B": dir_b}.items()}


@functools.lru_cache(maxsize=2)
def logprobs_reference(dir_a: str, dir_b: str) -> dict[str, dict[int, LogprobReference]]:
    """transformers' log probabilities along every prompt and its greedy tokens, per set."""
    greedy = reference(dir_a, dir_b)

    def compute(w: str, model_dir: str, prompt: int) -> LogprobReference:
        tokens = greedy[w][prompt]
        assert tokens is not None
        return logprob_reference(model_dir, PROMPTS[prompt], tokens)

    return {
        w: Computed(functools.partial(compute, w, d)) for w, d in {"A": dir_a, "B": dir_b}.items()
    }


@dataclasses.dataclass(frozen=True)
class Int8Reference:
    tokens: list[int]  # transformers' greedy tokens on the dequantized weights
    margin: float  # their smallest top-1 logit lead
    rows: LogprobReference
    bytes_low: int  # the weights' bytes: bfloat16, but one byte per linear weight


@functools.lru_cache(maxsize=2)
def int8_reference(model_dir: str) -> Int8Reference:
    """What an int8 start of ``model_dir`` must serve for ``INT8_PROMPT``: the weights in
    bfloat16, each linear weight (the embedding too, where the head shares it) rounded to
    int8 per row and dequantized, written once beside the model as float32 for
    transformers."""
    source = Path(model_dir)
    target = source.with_name(f"{source.name}-int8-dequantized")
    tied = bool(json.loads((source / "config.json").read_text()).get("tie_word_embeddings"))
    linear = ("proj.weight", "lm_head.weight", *(["embed_tokens.weight"] if tied else []))
    named, low = {}, 0
    for name, tensor in read_dir_weights(source):
        weight = tensor.to(torch.bfloat16)
        low += weight.numel() * (1 if name.endswith(linear) else 2)
        if name.endswith(linear):
            panels, scales = kernels.quantize_panels(weight)
            weight = kernels.dequantize_rows(panels, scales, torch.arange(weight.shape[0]))
        named[name] = weight.float().contiguous()
    if not target.exists():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors*"))
        save_file(named, str(target / "model.safetensors"), metadata={"format": "pt"})
    prompt = PROMPTS[INT8_PROMPT]
    tokens, margin = hf_greedy_with_margin(target, prompt, INT8_TOKENS)
    return Int8Reference(tokens, margin, logprob_reference(str(target), prompt, tokens), low)


@functools.lru_cache(maxsize=1)
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def expected_text(model_dir: str, prompt: list[int], tokens: list[int]) -> str:
    """The text of ``tokens`` after ``prompt``, as one decoding of them all gives it (the
    streamed chunks must add up to it, held-back partial characters included)."""

    def decode(ids: list[int]) -> str:
        text: str = tokenizer(model_dir).decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text

    context = prompt[-5:]  # the detokenizer's context: the prompt's last tokens
    return decode(context + tokens)[len(decode(context)) :]


@functools.lru_cache(maxsize=2)
def weight_sets(dir_a: str, dir_b: str) -> dict[str, list[tuple[str, torch.Tensor]]]:
    return {"A": read_dir_weights(Path(dir_a)), "B": read_dir_weights(Path(dir_b))}


async def _host(*, task_status: anyio.abc.TaskStatus[anyio.abc.TaskGroup]) -> None:
    async with anyio.create_task_group() as tg:
        task_status.started(tg)
        await anyio.sleep_forever()


class LifecycleMachine(RuleBasedStateMachine):
    dir_a: Path
    dir_b: Path
    backend: str
    kind: str  # lifecycle_driver.KINDS

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = start_blocking_portal(self.backend)
        self.portal = self._portal_cm.__enter__()
        self.host, self.tg = self.portal.start_task(_host)
        self.reference = reference(str(self.dir_a), str(self.dir_b))
        self.logprobs_reference = logprobs_reference(str(self.dir_a), str(self.dir_b))
        assert not checker_problems(), checker_problems()  # the block check the machine uses
        self.weights = weight_sets(str(self.dir_a), str(self.dir_b))
        self.driver: EngineDriver | None = None
        self.model = EngineModel("reject")
        self.when_asleep = "reject"
        self.ids = itertools.count()
        self.num_engines = 0
        self.num_deaths = 0
        self.smallest_started = False
        self.all_faults_done = False
        self.kept_cycle_done = False

    @initialize(when_asleep=st.sampled_from(["reject", "wait"]))
    def start_engine(self, when_asleep: str = "reject", block_bytes: int | None = None) -> None:
        """With ``block_bytes`` (one KV block's size), the KV cache is sized by memory, to
        ``NUM_BLOCKS`` blocks exactly; else by ``num_blocks``."""
        self.when_asleep = when_asleep
        size: dict[str, Any] = {"num_blocks": NUM_BLOCKS}
        if block_bytes is not None:
            size = {"num_blocks": None, "kv_cache_memory": NUM_BLOCKS * block_bytes}
        config = tiny_config(
            self.dir_a,
            max_model_len=MAX_MODEL_LEN,
            when_asleep=when_asleep,
            step_timeout=STEP_TIMEOUT,
            **size,
        )
        self.num_engines += 1
        self.driver = EngineDriver(self.portal, config, self.num_engines, self.kind)
        self.model = EngineModel(when_asleep)
        if self.d.inside:
            total = self.d.run_sync(lambda: self.d.engine.stats().num_total_blocks)
            assert total == NUM_BLOCKS, f"{total} KV blocks planned, {NUM_BLOCKS} wanted"
        if self.kind != "uni" and self.num_engines == 1:
            # these kinds run one example in CI, hypothesis's simplest (no request at all):
            # every example starts with two requests, so that even that one serves some
            self.admit(2, MAX_TOKENS, n=2, seed=7, temperature=0.8)
            self.admit(4, MAX_TOKENS)

    def start_fresh_engine_after_a_refusal(self) -> None:
        """A refused start, then a fresh engine whose KV cache is sized by memory: the
        refusal names one block's size, and a budget of ``NUM_BLOCKS`` of them must give
        exactly ``NUM_BLOCKS`` blocks. The first time, in between, the other refused start,
        the smallest engine and an int8 one."""
        block_bytes = self.refused_start()
        if not self.smallest_started:
            self.smallest_started = True
            self.refused_start("quantized float32")
            self.smallest_start(block_bytes)
            self.quantized_start()
            self.held_through_sleep()
            self.split_prompt_start(block_bytes)
            self.eviction_order_start()
        self.start_engine(self.when_asleep, block_bytes=block_bytes)

    def on_extra_engine(self, config: Any, body: Callable[[Any], Awaitable[T]]) -> T:
        """Start an extra engine of ``config``, run ``body`` on it (bounded), stop it, and
        check that it stopped cleanly and left no process behind; ``body``'s result."""
        children = child_pids()
        engine = make_engine(self.kind, config, FaultInjector())
        run, _ = self.portal.start_task(engine.run)

        async def bounded() -> T:
            with anyio.fail_after(BOUND):
                return await body(engine)

        try:
            result = self.portal.call(bounded)
        finally:
            self.portal.call(engine.stop)
        assert run.result(timeout=BOUND) is None
        assert child_pids() <= children, f"an engine of {config} left a process behind"
        return result

    def serve_once(
        self, config: Any, prompt: list[int], params: SamplingParams, *, asleep: bool = False
    ) -> tuple[list[Any], int, int]:
        """Serve one request on an extra engine of ``config`` (``on_extra_engine``): its
        chunks, its KV blocks (the process kind: -1, not shown) and its weights' bytes
        while it ran. ``asleep`` (``when_asleep="wait"``): the engine sleeps (level 2)
        before the request comes, so it is held, then wakes up one tag at a time; its
        chunks are read only then."""

        async def serve(engine: Any) -> tuple[list[Any], int, int]:
            if asleep:
                await engine.sleep(2)
            stream = engine.generate(prompt, params)
            if asleep:
                await engine.wakeup(["kv_cache"])  # still asleep: held
                await engine.wakeup(["weights"])  # awake: serves
            chunks = [chunk async for chunk in stream]
            blocks = engine.stats().num_total_blocks if self.kind != "process" else -1
            memory = engine.memory_stats()
            return chunks, blocks, sum(m.weights_bytes for m in memory.values())

        return self.on_extra_engine(config, serve)

    def smallest_start(self, block_bytes: int) -> None:
        """A KV cache budget of exactly one block is the smallest that starts: the engine
        plans that one block and serves the smallest request that asks for everything (a
        prompt of two tokens, one generated, the log probabilities of both: transformers'
        greedy token and figures), then stops, leaving no process."""
        config = tiny_config(
            self.dir_a, num_blocks=None, kv_cache_memory=block_bytes, max_model_len=MAX_MODEL_LEN
        )
        prompt = PROMPTS[5][:2]
        params = SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
        )
        chunks, blocks, _ = self.serve_once(config, prompt, params)
        assert blocks in (1, -1), f"{blocks} KV blocks planned for a budget of one block"
        want = hf_greedy(self.dir_a, prompt, 1)
        got = [(c.token_ids, c.finish_reason) for c in chunks]
        assert got == [(want, "length")], (got, want)
        ref = logprob_reference(str(self.dir_a), prompt, want)
        chunk = chunks[0]
        assert chunk.prompt_logprobs is not None and chunk.logprobs is not None, chunk
        assert chunk.prompt_logprobs[0] is None, chunk
        figures = [chunk.prompt_logprobs[1], chunk.logprobs[0]]
        wants = [ref.prompt[1], float(ref.rows[0, want[0]])]
        assert all(
            f is not None and w is not None and abs(f - w) <= TOLERANCE
            for f, w in zip(figures, wants, strict=True)
        ), (figures, wants)

    def held_through_sleep(self) -> None:
        """An engine with ``when_asleep="wait"`` takes a request while it sleeps (held) and
        serves it once every tag is awake again. The machine's own engine draws
        ``when_asleep``, and which examples hold a request over a whole wakeup is luck
        (round 23: no derandomized example did); here, once per example, it is certain
        (fixed sub-steps: no draws). The request asks for ``n=2`` greedy sequences under
        the ``choice`` constraint (the request rules never combine the two): each must be
        transformers' constrained greedy tokens, up to the EOS that ends them."""
        config = tiny_config(
            self.dir_a, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, when_asleep="wait"
        )
        ref = self.reference["A"]
        prompt = next(p for p in range(len(PROMPTS)) if ref[(p, "choice")] is not None)
        model = RequestModel(
            request_id="held",
            engine_no=0,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            stop_token=None,
            weights="A",
            break_after=None,
            held=True,
            constraint="choice",
            eos_ids=eos_ids(str(self.dir_a)),
        )
        want = model.natural_tokens(self.reference)
        assert want is not None
        reason = "stop" if want[-1] in model.eos_ids else "length"
        params = SamplingParams(
            n=2, max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=CASES["choice"]
        )
        chunks, _, _ = self.serve_once(config, PROMPTS[prompt], params, asleep=True)
        for index in (0, 1):
            mine = [c for c in chunks if c.index == index]
            got = ([t for c in mine for t in c.token_ids], mine[-1].finish_reason if mine else None)
            assert got == (want, reason), (index, got, want)

    def eviction_order_start(self) -> None:
        """Free blocks are reused oldest-freed first (LRU, as in vLLM), so the prefix that
        ended last is the last one lost. A fresh engine (its own process kinds aside: their
        stats are snapshots) serves two 8-token prompts, each to its end, then one that
        takes 8 of the 12 blocks: the 4 left are the two prompts', so the second prompt,
        asked again, must hit its first block in the prefix cache. (Newest-freed first,
        the long prompt would have taken the second prompt's blocks first.)"""
        if self.kind == "process":
            return
        config = tiny_config(self.dir_a, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
        first, second = list(range(60, 68)), list(range(80, 88))
        longest = list(range(100, 131))  # 31 tokens: 8 blocks
        one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        async def serve(engine: Any) -> int:
            for prompt in (first, second, longest):
                [chunk async for chunk in engine.generate(prompt, one_token)]
            before = engine.stats().prefix_cache_hits_total
            [chunk async for chunk in engine.generate(second, one_token)]
            return int(engine.stats().prefix_cache_hits_total - before)

        hits = self.on_extra_engine(config, serve)
        assert hits >= 4, f"{hits} prompt tokens hit: the last prefix freed was reused first"

    def split_prompt_start(self, block_bytes: int) -> None:
        """An engine with the default KV sizing (on a CPU: a budget of
        ``CPU_KV_CACHE_BYTES``, at most ``max_num_seqs`` sequences of ``max_model_len``) and
        a budget of ``SPLIT_BUDGET`` tokens per step, so that a prompt's prefill is split
        across steps (the machine's own engines never split one). A greedy request asks for
        its prompt's log probabilities (each transformers', whichever step computed it) and
        for ``min_tokens`` under a ``logit_bias`` that makes EOS the top token: EOS is held
        back for ``min_tokens`` tokens (transformers' greedy ones), then comes at once."""
        config = tiny_config(
            self.dir_a,
            num_blocks=None,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=SPLIT_BUDGET,
        )
        eos = min(eos_ids(str(self.dir_a)))
        params = SamplingParams(
            max_tokens=SPLIT_MIN_TOKENS + 2,
            temperature=0.0,
            min_tokens=SPLIT_MIN_TOKENS,
            logit_bias={eos: 100.0},
            prompt_logprobs=PROMPT_LOGPROBS,
        )
        chunks, blocks, _ = self.serve_once(config, PROMPTS[SPLIT_PROMPT], params)
        if not torch.cuda.is_available():  # the engine runs on the CPU
            seqs = config.max_num_seqs * -(-MAX_MODEL_LEN // config.block_size)
            plan = min(CPU_KV_CACHE_BYTES // block_bytes, seqs)
            assert blocks in (plan, -1), f"{blocks} KV blocks planned, {plan} wanted"
        greedy = self.reference["A"][SPLIT_PROMPT]
        assert greedy is not None and not set(greedy[:SPLIT_MIN_TOKENS]) & eos_ids(
            str(self.dir_a)
        ), greedy
        got = ([t for c in chunks for t in c.token_ids], chunks[-1].finish_reason)
        want = ([*greedy[:SPLIT_MIN_TOKENS], eos], "stop")
        assert got == want, (got, want)
        figures = chunks[0].prompt_logprobs
        wants = self.logprobs_reference["A"][SPLIT_PROMPT].prompt
        assert figures is not None and len(figures) == len(wants), (figures, wants)
        assert figures[0] is None and all(
            f is not None and w is not None and abs(f - w) <= TOLERANCE
            for f, w in zip(figures[1:], wants[1:], strict=True)
        ), (figures, wants)

    def quantized_start(self) -> None:
        """An int8 start (``quantization="int8"`` on the model in bfloat16; where this CPU
        runs int8 panels) serves a greedy request with log probabilities: its tokens are
        transformers' on the weights it holds (each linear weight's rows rounded to int8
        with their own scale, dequantized), its figures within ``INT8_TOLERANCE`` of
        transformers', and its weights take about one byte per linear weight. The same
        again on an engine that first sleeps at level 2 and wakes up (it reloads from disk
        and quantizes again: the weights the machine's float32 engines reload keep their
        dtype trivially, a half-precision engine's must too)."""
        if not can_pack_panels(torch.bfloat16):
            return
        ref = int8_reference(str(self.dir_a))
        assert ref.margin >= INT8_MARGIN, f"the int8 reference leads by {ref.margin} only"
        for asleep in (False, True):
            config = tiny_config(
                self.dir_a,
                dtype="bfloat16",
                quantization="int8",
                num_blocks=NUM_BLOCKS,
                max_model_len=MAX_MODEL_LEN,
                when_asleep="wait" if asleep else "reject",
            )
            self.check_int8_serve(config, ref, asleep)

    def check_int8_serve(self, config: Any, ref: Int8Reference, asleep: bool) -> None:
        prompt = PROMPTS[INT8_PROMPT]
        params = SamplingParams(
            max_tokens=INT8_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1
        )
        chunks, _, size = self.serve_once(config, prompt, params, asleep=asleep)
        tokens = [t for c in chunks for t in c.token_ids]
        reasons = [c.finish_reason for c in chunks]
        assert (tokens, reasons[-1]) == (ref.tokens, "length"), (asleep, tokens, reasons)
        figures = [f for c in chunks for f in c.logprobs or []]
        wants = [float(ref.rows.rows[i, t]) for i, t in enumerate(ref.tokens)]
        assert len(figures) == len(wants) and all(
            abs(f - w) <= INT8_TOLERANCE for f, w in zip(figures, wants, strict=True)
        ), (asleep, figures, wants)
        assert ref.bytes_low <= size <= ref.bytes_low * 1.05, (asleep, size, ref.bytes_low)

    @property
    def d(self) -> EngineDriver:
        assert self.driver is not None
        return self.driver

    def live(self) -> list[RequestModel]:
        return [r for r in self.d.requests if not r.done.is_set()]

    # -- requests -------------------------------------------------------------------

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_tokens=st.integers(1, MAX_TOKENS),
        stop_at=st.none() | st.integers(0, MAX_TOKENS - 1),
        break_after=st.none() | st.integers(1, 6),
    )
    def submit(
        self, prompt: int, max_tokens: int, stop_at: int | None, break_after: int | None
    ) -> None:
        self.admit(prompt, max_tokens, stop_at, break_after)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), after=st.integers(1, 3))
    def submit_and_break_off(self, prompt: int, after: int) -> None:
        """A consumer that leaves after a few chunks of a long request (dropping its
        stream must abort it at once)."""
        self.admit(prompt, MAX_TOKENS, None, after)

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_tokens=st.integers(1, MAX_TOKENS),
        sampling=st.sampled_from([*CONSTRAINTS, "logprobs"]),
        break_after=st.none() | st.integers(1, 6),
    )
    def submit_sampling(
        self, prompt: int, max_tokens: int, sampling: str, break_after: int | None
    ) -> None:
        """A request with structured outputs (its tokens: the greedy ones under the
        constraint), or with log probabilities of its tokens and its prompt."""
        self.admit(prompt, max_tokens, None, break_after, sampling)

    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        n=st.integers(1, 2),
        temperature=st.sampled_from([0.0, 0.8]),
        seed=st.integers(0, 3),
        max_tokens=st.integers(1, MAX_TOKENS),
        break_after=st.none() | st.integers(1, 8),
    )
    def submit_several(
        self,
        prompt: int,
        n: int,
        temperature: float,
        seed: int,
        max_tokens: int,
        break_after: int | None,
    ) -> None:
        """A request for ``n`` sequences on one stream, greedy (each equals the greedy
        reference) or sampled with a seed (sequence ``i`` samples with ``seed + i``, as
        docs/sampling.md promises: its tokens are those of an ``n=1`` request with that
        seed, whatever else runs beside it). Aborting, breaking off or cancelling ends all."""
        self.admit(prompt, max_tokens, None, break_after, n=n, seed=seed, temperature=temperature)

    def admit(
        self,
        prompt: int,
        max_tokens: int,
        stop_at: int | None = None,
        break_after: int | None = None,
        sampling: str | None = None,
        *,
        n: int = 1,
        seed: int | None = None,
        temperature: float = 0.0,
        dying: list[Exception] | None = None,
        public_id: str | None = None,
    ) -> RequestModel | None:
        """Submit a request; returns the model of its (first) sequence, None if refused.
        ``sampling``: a constraint of ``CONSTRAINTS``, or "logprobs". ``dying``: a fault
        that kills the engine is armed, so ``EngineDeadError`` may refuse it (added there).
        ``public_id``: its id (else a fresh ``m<number>``)."""
        model = self.model
        want = model.admission_error()
        stop_token = stop_text = stop_end = None
        constraint = sampling if sampling in CONSTRAINTS else None
        logprobs = sampling == "logprobs" or (sampling is None and prompt in LOGPROB_PROMPTS)
        logprobs = logprobs and temperature == 0  # greedy: the token is the most likely
        # the context ends a long request first: "length" at MAX_MODEL_LEN tokens in all
        produced = min(max_tokens, MAX_MODEL_LEN - len(PROMPTS[prompt]))
        if stop_at is not None and stop_at < produced and constraint is None:
            free = self.reference[model.weights][prompt]
            assert free is not None  # only constrained references may be missing
            if stop_at % 2:  # a stop string: the text its token adds
                stop_text, stop_end = self.stop_string(prompt, free[:produced], stop_at)
            if stop_text is None:
                stop_token = free[stop_at]
        public_id = public_id or f"m{next(self.ids)}"
        members = [
            RequestModel(
                request_id=f"{public_id}#{i}" if n > 1 else public_id,
                public_id=public_id,
                index=i,
                seed=None if seed is None else seed + i,
                temperature=temperature,
                version=model.version,
                engine_no=self.d.number,
                prompt=prompt,
                max_tokens=produced,
                stop_token=stop_token,
                stop_text=stop_text,
                stop_end=stop_end,
                weights=model.weights,
                break_after=break_after,
                held=model.holds_new_requests(),
                constraint=constraint,
                eos_ids=eos_ids(str(self.dir_a)) if constraint else frozenset(),
                logprobs=logprobs,
            )
            for i in range(n)
        ]
        req = members[0]
        params = SamplingParams(
            n=n,
            seed=seed,
            max_tokens=max_tokens,
            temperature=temperature,
            ignore_eos=constraint is None,  # a complete grammar ends with EOS
            stop_token_ids=() if stop_token is None else (stop_token,),
            stop=() if stop_text is None else (stop_text,),
            structured_outputs=CASES[constraint] if constraint else None,
            logprobs=LOGPROBS if req.logprobs else None,
            prompt_logprobs=PROMPT_LOGPROBS if req.logprobs else None,
        )
        error = self.d.admit(self.tg, members, PROMPTS[prompt], params)
        if want is None and dying is not None and isinstance(error, EngineDeadError):
            dying.append(error)
            return None
        if want is None:
            assert error is None, error
            return req
        assert isinstance(error, want), (error, want)
        return None

    def stop_string(
        self, prompt: int, tokens: list[int], at: int
    ) -> tuple[str, int] | tuple[None, None]:
        """The text token ``at`` adds after ``tokens[:at]``, and the index of the first
        token that completes it; (None, None) where the token adds no whole character."""
        text = functools.partial(expected_text, str(self.dir_a), PROMPTS[prompt])
        before, after = text(tokens[:at]), text(tokens[: at + 1])
        added = after[len(before) :]
        if not added or not after.startswith(before) or "\ufffd" in added:
            return None, None
        return added, next(k for k in range(at + 1) if added in text(tokens[: k + 1]))

    def pick(self, pick: int) -> RequestModel:
        """A request the engine still runs if there is one (which one varies with timing; the
        drawn data do not), else any."""
        live = self.d.live_ids()
        candidates = [r for r in self.d.requests if r.request_id in live] or self.d.requests
        return candidates[pick % len(candidates)]

    def group(self, req: RequestModel) -> list[RequestModel]:
        """The models of every sequence of ``req``'s request (one stream)."""
        return [r for r in self.d.requests if r.done is req.done]

    @precondition(lambda self: self.driver is not None and self.driver.requests)
    @rule(pick=st.integers(0, 255))
    def abort(self, pick: int) -> None:
        req = self.pick(pick)

        def abort_now() -> set[str]:
            live = self.d.live_ids()
            self.d.engine.abort(req.public_id)  # all its sequences
            return live

        for member in self.requests_in(self.d.run_sync(abort_now) & set(self.group_ids(req))):
            # live when aborted: nothing else may end it
            if self.d.inside:
                member.allowed, member.must_end = {"abort"}, True
            else:  # its end may be on its way from the engine process
                member.may_end("abort")

    def group_ids(self, req: RequestModel) -> list[str]:
        return [r.request_id for r in self.group(req)]

    @precondition(lambda self: self.driver is not None and self.driver.requests)
    @rule(pick=st.integers(0, 255))
    def cancel_consumer(self, pick: int) -> None:
        req = self.pick(pick)
        for member in self.group(req):
            if not member.seen_end:
                member.may_end("abort")
        self.d.cancel_consumer(req)

    # -- control --------------------------------------------------------------------

    def control(self, fn: Any, *args: Any) -> tuple[set[str], Any]:
        """Call ``fn(*args)``; the ids live just before it (same loop tick), and its error."""

        async def call() -> tuple[set[str], Any]:
            live = self.d.live_ids()
            try:
                await fn(*args)
            except Exception as exc:
                return live, exc
            return live, None

        result: tuple[set[str], Any] = self.d.call(call)
        return result

    def expect(self, error: Any, want: type[Exception] | None, action: str = "") -> None:
        """``error`` is ``want`` (None: no error); an illegal call's message names the call
        and the state, as DESIGN.md says."""
        if want is None:
            assert error is None, error
            return
        assert isinstance(error, want), (error, want)
        if want is IllegalStateError:
            assert str(error) == f"cannot {action} while the engine is {self.model.state}", error

    def requests_in(self, ids: set[str]) -> list[RequestModel]:
        return [r for r in self.d.requests if r.request_id in ids]

    def busy(self, busy: bool) -> None:
        """With ``busy``, a request is running (it needs dozens of steps) or held when the next
        call comes."""
        if busy and self.model.admission_error() is None:
            self.admit(1, MAX_TOKENS)

    @precondition(lambda self: self.driver is not None)  # stopped too: refused
    @rule(mode=st.sampled_from(["abort", "drain", "keep"]), busy=st.booleans())
    def pause(self, mode: str, busy: bool = False) -> None:
        self.busy(busy)
        was = self.model.state
        want = self.model.pause(mode)
        args = () if mode == "abort" else (mode,)  # "abort" is the default
        live, error = self.control(self.d.engine.pause, *args)
        self.expect(error, want, "pause")
        if want is None and was is not S.SLEEPING:
            self.paused(self.requests_in(live), mode)
        if want is None and mode == "keep" and self.d.inside and self.live():
            # frozen requests are work the engine may not step: its loop waits, not spins
            blocked = self.d.call(anyio.wait_all_tasks_blocked)
            assert blocked is None, f"paused with frozen requests, a task kept running: {blocked!r}"

    def paused(self, reqs: list[RequestModel], mode: str) -> None:
        for req in reqs:
            if mode == "abort":
                req.may_end("abort")
            elif mode == "drain" and not req.held:
                req.must_end = True  # drained: ended by now, naturally

    @precondition(lambda self: self.driver is not None)  # stopped too: refused
    @rule()
    def resume(self) -> None:
        want = self.model.resume()
        _, error = self.control(self.d.engine.resume)
        self.expect(error, want, "resume")
        self.released_if_running()

    def released_if_running(self) -> None:
        if self.model.state is S.RUNNING:
            for req in self.d.requests:
                req.held = False

    @precondition(lambda self: self.driver is not None)  # stopped too: refused
    @rule(
        level=st.sampled_from([1, 2]),
        mode=st.sampled_from(["abort", "drain", "keep"]),
        busy=st.booleans(),
    )
    def sleep(self, level: int, mode: str, busy: bool = False) -> None:
        self.busy(busy)
        was = self.model.state
        want = self.model.sleep(level, mode)
        live, error = self.control(self.d.engine.sleep, level, mode)
        self.expect(error, want, "sleep")
        if want is None and was is not S.SLEEPING:
            self.paused(self.requests_in(live), mode)

    @precondition(lambda self: self.driver is not None)  # stopped too: refused
    @rule(
        tags=st.lists(st.sampled_from(["weights", "kv_cache"]), min_size=1, unique=True),
        busy=st.booleans(),
    )
    def wakeup(self, tags: list[str], busy: bool = False) -> None:
        self.busy(busy)  # asleep with when_asleep="wait": a held request, released on wakeup
        want = self.model.wakeup(tags)
        _, error = self.control(self.d.engine.wakeup, tags)
        self.expect(error, want, "wake up")
        self.weights_are(self.model.weights)
        self.released_if_running()

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule(mode=st.sampled_from(["abort", "drain"]), weights_first=st.booleans())
    def deep_sleep_cycle(self, mode: str, weights_first: bool) -> None:
        """A whole level-2 cycle with a request on: sleep, wake the weights (reloaded from
        disk: a new ``weight_version``) and the KV cache one at a time, in either order,
        checking the engine between the steps; on the way, an update refused while the
        weights sleep, a level-1 sleep after the first wakeup (it releases that memory
        again), and, weights first, new weights before the KV cache wakes (the RL cycle);
        then, awake, a pause in "keep" mode followed by one in "abort" mode (a request
        after it: refused), a level-1 sleep, then a level-2 one (the offloaded weights go
        too), and a wakeup while paused (back to paused), a resume, an update from the
        weights' directory, a request with a stop string, one asking for log probabilities of
        a prompt whose prefix that request left cached, and a long request
        whose id a second request asks for while it runs (refused, and so is an ``n = 2``
        request whose member id it is), then aborted.
        Random rule draws seldom reach these; this rule always does, with fixed sub-steps
        (no draws depend on the engine)."""
        self.sleep(2, mode, busy=True)
        self.check_engine()
        self.update_weights("B")  # staged while the weights sleep (the mp kind: refused)
        first, second = (
            (["weights"], ["kv_cache"]) if weights_first else (["kv_cache"], ["weights"])
        )
        self.wakeup(first, busy=True)
        self.check_engine()
        self.sleep(1, mode)  # after a partial wakeup: releases what was woken again
        self.check_engine()
        self.wakeup(first, busy=True)
        if weights_first:
            self.update_weights("B")  # the RL cycle: new weights before the KV cache wakes
        self.wakeup(second, busy=True)
        self.check_engine()
        # paused already ("keep"), a pause in "abort" mode still takes that mode: what it
        # froze ends, and new requests are refused until resume
        self.pause("keep", busy=True)
        self.pause("abort")
        self.admit(0, 1)  # refused: EnginePausedError
        self.sleep(1, mode)  # a paused engine may sleep; waking gives the pause back
        self.check_engine()
        self.sleep(2, mode)  # asleep at level 1: level 2 drops the offloaded weights too
        self.check_engine()
        self.wakeup(["weights", "kv_cache"])
        self.check_engine()
        self.resume()
        self.update_weights("A from its directory")  # running: read from disk, off the loop
        free = self.reference["A"][3]
        assert free is not None
        at = next(i for i in range(1, 16, 2) if self.stop_string(3, free, i)[0] is not None)
        stopping = self.admit(3, MAX_TOKENS, stop_at=at)  # "stop", and the text before it
        assert stopping is not None and stopping.stop_text is not None
        assert not self.d.wait_ended([stopping]), "a request with a stop string never ended"
        # its prompt's blocks are cached now; a prefix of it asking for log probabilities
        # computes them again (every position's log probabilities, as the reference's)
        logprobs = self.admit(1, 4, sampling="logprobs")
        assert logprobs is not None and logprobs.logprobs
        assert not self.d.wait_ended([logprobs]), "a request with log probabilities never ended"
        self.check_ended_requests()
        # needs dozens of steps: live when aborted, it ends "abort"; its id has the shape of
        # an n > 1 request's member id
        self.admit(1, MAX_TOKENS, public_id=f"m{next(self.ids)}#1")
        self.duplicate_request_id(0)  # its id, while it runs: refused, naming the field
        self.abort(0)

    def weights_are(self, weights: str) -> None:
        for req in self.live():
            req.weights_changed(weights)

    @precondition(lambda self: self.driver is not None)  # stopped too: refused
    @rule(
        weights=st.sampled_from(["A", "B", "A from its directory", *INVALID_WEIGHTS]),
        kept_kv=st.sampled_from(["recompute", "reuse"]),
    )
    def update_weights(self, weights: str, float64: bool = False, kept_kv: str = "") -> None:
        """``float64``: the tensors in another float dtype than the model's (converted on
        the way in; float32 values survive the round trip exactly). ``kept_kv``: what
        requests holding KV keep ("": the default, "recompute"; "reuse" is refused while
        asleep, where sleep released that KV)."""
        options = {"kept_kv": kept_kv} if kept_kv else {}
        kept_kv = options.get("kept_kv", "recompute")
        culprit = ""
        named: Any
        if weights == "A from its directory":
            named, want = str(self.dir_a), self.model.update_weights("A", kept_kv)
        elif weights in INVALID_WEIGHTS:  # a valid tensor first: nothing may be applied
            (name, tensor), (bad, good) = self.weights["B"][:2]
            wrong, culprit = INVALID_WEIGHTS[weights](bad, good)
            named = [(name, tensor), wrong]
            want = self.model.update_weights(None)
        else:
            named = self.weights[weights]
            if float64:
                named = [(name, tensor.double()) for name, tensor in named]
            want = self.model.update_weights(weights, kept_kv)
        kept: list[int] = []

        async def update() -> None:
            await self.d.engine.update_weights(named, **options)
            kept.append(self.d.cached_prefixes())  # no step ran with the new weights yet

        _, error = self.control(update)
        self.expect(error, want, "update weights")
        if want is ValueError:
            assert isinstance(error, InvalidRequestError), error
            if kept_kv == "reuse" and self.model.state is S.SLEEPING:  # checked first
                assert error.field == "kept_kv" and "released the KV" in str(error), error
            else:
                assert error.field == "weights", error
                assert culprit in str(error), (culprit, error)  # it names the tensor and fault
        assert kept in ([], [0]), f"{kept} prefixes computed with the old weights kept"
        self.weights_are(self.model.weights)

    @precondition(lambda self: self.driver is not None)
    @rule(
        weights=st.sampled_from(["A", "B", "bad part"]),
        num_parts=st.integers(1, 3),
        end=st.sampled_from(["commit", "raise", "cancel"]),
        held=st.booleans(),
    )
    def update_in_parts(self, weights: str, num_parts: int, end: str, held: bool) -> None:
        """``weight_update()``: the weights pushed in ``num_parts`` parts; the block ends
        cleanly (everything applies at once), raises or is cancelled (nothing applies), or
        a part is invalid (refused naming its tensor, nothing applies). A second update
        while this one is open is refused; a committed one cannot be entered again.
        (ProcessEngine: each part through shared memory, the block's end as a message.)
        ``held``: each part written to a file of its own in /dev/shm and pushed by path,
        held (mapped until the update ends); once it ended the files are written over with
        the other weights, as a trainer's next update would: what applied must not change,
        nor what waits for a wakeup."""
        named = self.weights["A" if weights == "bad part" else weights]
        size = -(-len(named) // num_parts)
        parts = [named[i : i + size] for i in range(0, len(named), size)]
        trial = dataclasses.replace(self.model)
        want = trial.update_weights(None if weights == "bad part" else weights)
        second: list[Any] = []
        entered: list[Any] = []
        shared = new_weights_dir() if held else None
        files = [shared / f"part-{i}.safetensors" for i in range(len(parts))] if shared else []

        async def update() -> None:
            engine = self.d.engine
            with anyio.CancelScope() as scope:
                async with engine.weight_update() as u:
                    entered.append(u)
                    for i, part in enumerate(parts):
                        if held:
                            write_weights_file(part, files[i])
                            await u.push_file(files[i], hold=True)
                        else:
                            await u.push(part)
                    try:
                        async with engine.weight_update():
                            pass
                    except IllegalStateError as exc:
                        second.append(exc)
                    if weights == "bad part":
                        await u.push([(parts[0][0][0], torch.zeros(3))])
                    if end == "raise":
                        raise KeyError("the trainer failed")
                    if end == "cancel":
                        scope.cancel()
                        await anyio.lowlevel.checkpoint()

        try:
            _, error = self.control(update)
            other = self.weights["B" if weights == "A" else "A"]
            for file in [f for f in files if f.exists()]:  # the trainer's next update,
                names = {n for n, _ in map_weights(file)}  # written over the same files
                write_weights_file([(n, t) for n, t in other if n in names], file)
        finally:
            if shared is not None:
                remove_weights_dir(shared)
        if want in (IllegalStateError, EngineSleepingError):  # refused when entered
            assert type(error) is want and not entered, (error, want)
            return
        assert len(second) == 1 and "second weight update" in str(second[0]), second
        if weights == "bad part":
            assert isinstance(error, InvalidRequestError), error
            assert f"{parts[0][0][0]}: shape (3,)" in str(error), error
        elif end == "raise":
            assert isinstance(error, KeyError), error
        else:
            assert error is None, error
        if error is None and end == "commit":
            self.model.update_weights(weights)
            self.weights_are(self.model.weights)
            _, again = self.control(entered[0].__aenter__)
            assert isinstance(again, InvalidRequestError) and "committed" in str(again), again
        self.check_engine()  # nothing applied but a committed update: version, weights

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule(level=st.sampled_from([1, 2]), weights=st.sampled_from(["A", "B"]))
    def keep_cycle(self, level: int, weights: str) -> None:
        """The RL cycle with requests kept (DESIGN.md §7): a request runs, the engine sleeps
        in "keep" mode (the request stays, its blocks go back: the checks after each step
        say so), an update reusing the KV is refused (sleep released it), one request kept
        is aborted asleep (it ends at once), the weights wake, new weights apply (their KV
        recomputed), the KV cache wakes: the kept requests go on. Then, awake, a pause in
        "keep" mode and an update that reuses the KV the old weights computed, and a resume.
        Fixed sub-steps: no draws."""
        self.kept_cycle_done = True
        self.busy(True)
        self.sleep(level, "keep", busy=True)  # two requests (at least) kept
        self.check_engine()
        self.update_weights(weights, kept_kv="reuse")  # refused: nothing changes
        self.check_engine()
        self.admit(1, MAX_TOKENS)  # refused, or (when_asleep="wait") held
        if self.live():
            self.abort(0)  # a kept request, asleep: it ends now
        self.check_engine()
        self.wakeup(["weights"])
        self.update_weights(weights)
        self.check_engine()
        self.wakeup(["kv_cache"])
        self.check_engine()
        self.pause("keep", busy=True)
        self.update_weights("A", kept_kv="reuse")
        self.check_engine()
        self.resume()
        self.check_engine()

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule(weights=st.sampled_from(["A", "B"]))
    def update_after_a_request(self, weights: str) -> None:
        """A short request ends (its full blocks stay cached as prefixes), then an invalid
        update changes nothing (``weight_version`` included), then the weights change (as
        float64 tensors: another float dtype is converted, not refused): those prefixes,
        computed with the old weights, must go at once. Then a request admitted with the new
        weights ends with a cache error (its error chunk carries the new ``weight_version``:
        random draws seldom make a cache error after an update)."""
        req = self.admit(1, 1)
        assert req is not None
        late = self.d.wait_ended([req])
        assert not late, f"a one-token request did not end: {late}"
        self.update_weights("wrong dtype")
        self.check_engine()
        self.update_weights(weights, float64=True)
        if self.model.state is S.RUNNING and self.d.inside:
            self.check_engine()
            self.cache_error(0, fresh=True)

    @precondition(lambda self: self.model.alive)
    @rule(call=st.sampled_from(sorted(INVALID_CALLS)))
    def invalid_call(self, call: str) -> None:
        """A call with an invalid argument raises ``InvalidRequestError`` naming it, in any
        state, and changes nothing (the invariants check the state); an unknown id's abort
        is a no-op. Preparing a constraint that does not compile raises it too."""
        names = sorted(INVALID_CALLS)  # all of them, the drawn one first
        for name in names[names.index(call) :] + names[: names.index(call)]:
            method, args, field, bad = INVALID_CALLS[name]
            if method == "abort":
                self.d.run_sync(self.d.engine.abort, "no-such-request")
                continue
            _, error = self.control(getattr(self.d.engine, method), *args)
            assert isinstance(error, InvalidRequestError) and error.field == field, (name, error)
            assert bad is None or repr(bad) in str(error), (name, error)
        # a constraint that does not compile, prepared ahead on a started engine (any state)
        bad_regex = SamplingParams(structured_outputs={"regex": "(("})
        _, error = self.control(self.d.engine.prepare_structured_outputs, bad_regex)
        assert isinstance(error, InvalidRequestError), error
        assert error.field == "structured_outputs" and "regex: " in str(error), error

    @precondition(lambda self: self.model.admission_error() is None)
    @rule(pick=st.integers(0, 255))
    def duplicate_request_id(self, pick: int) -> None:
        """A request id still in use is refused (``InvalidRequestError`` naming it), and so
        is a request with ``n > 1`` one of whose member ids (``{id}#{i}``) is in use."""
        live = sorted({r.public_id for r in self.requests_in(self.d.live_ids())})
        if not live:
            return
        taken = live[pick % len(live)]
        asks = [(taken, 1)]
        stem, sep, index = taken.rpartition("#")
        if sep and index.isdigit():
            asks.append((stem, int(index) + 1))  # member {stem}#{index} is `taken`

        def generate() -> list[tuple[str, Exception]]:
            if taken not in {r.public_id for r in self.requests_in(self.d.live_ids())}:
                return []  # it ended meanwhile
            errors = []
            for request_id, n in asks:
                params = SamplingParams(max_tokens=1, n=n)
                try:
                    self.d.engine.generate(PROMPTS[0], params, request_id=request_id)
                except Exception as exc:
                    errors.append((request_id, exc))
                    continue
                raise AssertionError(f"{request_id!r} (n={n}) was admitted beside {taken!r}")
            return errors

        for request_id, error in self.d.run_sync(generate):
            assert isinstance(error, InvalidRequestError), error
            assert error.field == "request_id" and repr(request_id) in str(error), error

    @precondition(lambda self: self.model.state is S.STOPPED)
    @rule()
    def start_fresh_engine(self) -> None:
        self.check_every_request_ended()
        self.start_fresh_engine_after_a_refusal()

    def refused_start(self, refusal: str = "kv budget") -> int:
        """Before a fresh engine: one that cannot start (``REFUSALS``: its KV cache budget
        is below one block; or it asks for int8 quantization of a float32 model). ``run()``
        raises ``EngineDeadError`` (its cause: the ``ModelLoadError`` naming the reason)
        before it serves (before it runs, it admits nothing and preparing a constraint is a
        no-op); that engine is dead, admits nothing, cannot run again and leaves
        no process behind. The valid start that follows must serve as if it never was.
        Returns one KV block's size in bytes, as the KV budget's refusal names it."""
        options, reason = REFUSALS[refusal]
        config = tiny_config(self.dir_a, max_model_len=MAX_MODEL_LEN, **options)
        children = child_pids()
        engine = make_engine(self.kind, config, FaultInjector())
        # before it starts: nothing is admitted, and preparing a constraint is a no-op
        early = self.portal.call(admission_error, engine)
        assert isinstance(early, IllegalStateError), early
        assert (
            str(early) == "cannot generate before the engine started while the engine is starting"
        )
        constrained = SamplingParams(structured_outputs=CASES["choice"])
        self.portal.call(engine.prepare_structured_outputs, constrained)
        self.holds_no_memory(engine)  # nothing loaded yet
        unstarted = engine.stats()  # no scheduler yet: no blocks, nothing counted
        assert (unstarted.num_total_blocks, unstarted.num_free_blocks) == (0, 0), unstarted
        assert unstarted.kv_cache_usage == 0.0 and unstarted.num_steps == 0, unstarted
        try:
            self.portal.start_task(engine.run)
        except EngineDeadError as exc:
            dead: BaseException = exc
        else:
            self.portal.call(engine.stop)
            raise AssertionError(f"an engine started with {options}")
        if self.kind != "process":  # the engine process reports its death by message
            cause = dead.__cause__
            assert isinstance(cause, ModelLoadError), (dead, cause)
            assert cause.model == str(self.dir_a), cause
            assert cause.reason.startswith(reason), (cause, reason)
        assert reason in str(dead), (dead, reason)
        assert engine.state is S.DEAD, engine.state
        self.holds_no_memory(engine)
        refused = self.portal.call(admission_error, engine)
        assert isinstance(refused, EngineDeadError), refused
        again = self.portal.call(engine_run_error, engine)
        assert isinstance(again, IllegalStateError), again
        assert child_pids() <= children, "a failed start left a process behind"
        named = re.search(r"below one block \((\d+) bytes\)", str(dead))
        return int(named.group(1)) if named is not None else 0

    def holds_no_memory(self, engine: Any) -> None:
        """``memory_stats()`` of an engine that holds no model: no bytes anywhere."""
        memory = self.portal.call(engine.memory_stats)
        held = [
            (m.device, m.weights_bytes, m.kv_cache_bytes, m.host_weights_bytes)
            for m in memory.values()
            if m.weights_bytes or m.kv_cache_bytes or m.host_weights_bytes
        ]
        assert not held, held

    @precondition(lambda self: self.model.alive)
    @rule(grace=st.sampled_from([0.0, BOUND / 3]), busy=st.booleans())
    def stop(self, grace: float, busy: bool = False) -> None:
        self.busy(busy)
        held = [r for r in self.live() if r.held]

        def stop_now() -> tuple[set[str], set[str]]:
            live = self.d.live_ids()
            self.d.engine.stop(grace)
            return live, self.d.live_ids()

        live, after = self.d.run_sync(stop_now)
        still_held = [r.request_id for r in held if r.request_id in after]
        assert not still_held or not self.d.inside, f"held requests outlived stop(): {still_held}"
        for req in self.requests_in(live):
            if req.held or grace == 0 or self.model.sleeping:
                req.may_end("abort")
            else:
                req.must_end = True  # they finish well within the grace
        assert self.d.run_future.result(timeout=BOUND) is None
        self.model.state = S.STOPPED
        again = self.d.call(self.d.engine.run)
        assert str(again) == "cannot run the engine twice while the engine is stopped", again
        self.check_refused_when_stopped()

    def check_refused_when_stopped(self) -> None:
        """Every control call on a stopped engine raises ``IllegalStateError`` naming it."""
        engine, model = self.d.engine, self.model
        calls = [
            ("pause", model.pause("drain"), engine.pause, ("drain",)),
            ("resume", model.resume(), engine.resume, ()),
            ("sleep", model.sleep(1, "abort"), engine.sleep, (1, "abort")),
            ("wake up", model.wakeup(["weights"]), engine.wakeup, (["weights"],)),
            (
                "update weights",
                model.update_weights("A"),
                engine.update_weights,
                (str(self.dir_a),),
            ),
        ]
        for action, want, fn, args in calls:
            _, error = self.control(fn, *args)
            self.expect(error, want, action)

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule(mode=st.sampled_from(["keep", "drain"]), grace=st.sampled_from([0.0, BOUND / 3]))
    def stop_while_held(self, mode: str, grace: float) -> None:
        """Pause with a request running, submit one (held while paused), stop: the held one
        ends at once. Random rule draws seldom stop while a request is held."""
        self.pause(mode, busy=True)
        self.admit(2, MAX_TOKENS)
        self.stop(grace)

    # -- faults ---------------------------------------------------------------------

    @precondition(lambda self: self.model.state is S.RUNNING and self.d.inside)
    @rule(pick=st.integers(0, 255))
    def cache_error(self, pick: int, fresh: bool = False) -> None:
        """One request's cache is not ready in a coming step (it ends with that error; the
        driver's step hook makes it the first step it shares with another running request,
        such as the sibling admitted here, which must end undisturbed). The rule waits for
        the victim's end, so that the error is seen before later rules pause or stop it.
        ``fresh``: the victim is a request admitted here."""
        victim = self.pick(pick) if self.d.requests and not fresh else None
        if victim is None or victim.request_id not in self.d.live_ids():
            victim = self.admit(pick % len(PROMPTS), MAX_TOKENS)
        self.admit((pick + 1) % len(PROMPTS), MAX_TOKENS)  # must end undisturbed
        assert victim is not None
        faults, victims = self.d.faults, self.d.cache_victims

        def arm() -> None:
            victims[victim.request_id] = faults.num_steps

        self.d.run_sync(arm)
        victim.may_end("error", cache_error_text(victim.request_id), now=False)  # if it runs
        self.d.wait_ended([victim])  # it may have been preempted, even more than once

    @precondition(lambda self: self.model.state is S.RUNNING and self.d.inside)
    @rule(pick=st.integers(0, 255))
    def grammar_fault(self, pick: int) -> None:
        """A constrained request's grammar rejects its next token (a token that escaped the
        mask): it alone ends with that error; a constrained sibling ends undisturbed."""
        victim = self.admit(pick % len(PROMPTS), MAX_TOKENS, sampling="regex")
        self.admit((pick + 1) % len(PROMPTS), MAX_TOKENS, sampling="choice")
        assert victim is not None
        rejects = self.d.call(reject_grammar, self.d.engine, victim.request_id)
        assert isinstance(rejects, bool), rejects
        if rejects:
            victim.may_end("error", grammar_error_text(), now=False)  # at its next sample
        late = self.d.wait_ended([victim])
        assert not late, f"a request whose grammar rejects it did not end: {late}"

    @precondition(
        lambda self: self.model.state is S.RUNNING and self.num_deaths < 2 and self.d.inside
    )
    @rule(kind=st.sampled_from(["raise", "hang"]))
    def step_fault(self, kind: str) -> None:
        """A step that raises or hangs: the engine dies, every request ends with that
        error. Random draws reach this rule a few times per run, and the cache-error rule
        may not be drawn at all; so the first time in an example, a cache error comes first
        (the engine survives it) and the other kind of death follows on the fresh engine
        (fixed sub-steps: no draws)."""
        self.num_deaths += 1
        first = not self.all_faults_done
        self.all_faults_done = True
        if first:
            self.cache_error(len(self.d.requests))
        self.die(kind)
        if first:
            self.die("hang" if kind == "raise" else "raise")

    def die(self, kind: str) -> None:
        faults, boom = self.d.faults, Boom("injected")

        def arm() -> None:
            if kind == "raise":
                faults.raise_at[faults.num_steps + 1] = boom
            else:  # a short step_timeout from now on; the step that hangs starts after it
                # (the next one may have taken its deadline already), and any step that
                # stalls meanwhile is the very death this rule expects
                loop = self.d.engine._loop
                loop.config = dataclasses.replace(loop.config, step_timeout=HANG_TIMEOUT)
                if self.kind == "uni":  # the agent's clean-up waits as long for the step
                    agent = self.d.engine._executor.agent
                    agent.config = dataclasses.replace(agent.config, step_timeout=HANG_TIMEOUT)
                faults.hang_at.add(faults.num_steps + 2)

        self.d.run_sync(arm)
        # a request, so that a step comes; but one that runs already takes the armed step
        # at once, and the engine may be dead of it before this request reaches it (the
        # cache-error sub-step leaves its sibling running): refused then with that death
        refused: list[Exception] = []
        self.admit(0, MAX_TOKENS, dying=refused)
        for req in self.d.requests:
            if not req.checked:  # even if its consumer has already seen the error
                req.may_end("error", death_error_text(kind, self.kind))
        late = self.d.wait_ended(self.live())  # every request ends at the fault, not later
        try:
            if kind == "hang" and self.kind == "uni":
                # run() ends while the step is still wedged: the clean-up does not wait
                # for it longer than step_timeout
                self.d.run_future.exception(timeout=BOUND)
                assert not faults.hang_returned.is_set(), "run() waited for the wedged step"
        finally:
            faults.release()
        assert not late, f"requests not ended by the engine's death: {late}"
        dead = self.d.run_future.exception(timeout=BOUND)
        assert isinstance(dead, EngineDeadError), dead
        assert all(r.__cause__ is dead.__cause__ for r in refused), (refused, dead)
        if kind == "raise" and self.kind == "mp":  # raised in the rank's process
            assert isinstance(dead.__cause__, WorkerFailed), dead.__cause__
            assert str(dead.__cause__) == "rank 0 raised Boom: injected", dead.__cause__
        elif kind == "raise":
            assert dead.__cause__ is boom
        else:
            assert isinstance(dead.__cause__, TimeoutError), dead.__cause__
        self.model.state = S.DEAD
        self.check_engine()
        self.admit(0, 1)  # refused: EngineDeadError
        self.check_every_request_ended()
        self.start_fresh_engine_after_a_refusal()

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def engine_agrees_with_model(self) -> None:
        if self.driver is not None:
            self.check_engine()

    def check_engine(self) -> None:
        model, d = self.model, self.d

        kv_alive = not model.alive or "kv_cache" not in model.sleeping
        serving = model.state in (S.RUNNING, S.STOPPING)
        held = {r.request_id for r in self.live() if r.held}

        def snapshot() -> dict[str, Any]:
            engine = d.engine
            return {
                "state": engine.state,
                "stats_state": engine.stats().state,
                "tags": set(engine.sleeping_tags),
                "is_sleeping": engine.is_sleeping,
                "version": engine.weight_version,
                "admission": admission_error(engine),
                "problems": d.blocks_problems(kv_cache_resident=kv_alive)
                + d.placement_problems(serving, held)
                + d.stepping_problems(model.can_step)
                + d.counter_problems()
                + d.observer_problems()
                + d.memory_problems(*model.memory()),
            }

        snap = d.run_sync(snapshot)
        assert snap["state"] is model.state, (snap["state"], model.state)
        assert snap["stats_state"] == str(model.state), (snap["stats_state"], model.state)
        tags = model.sleeping if model.alive else set()
        assert snap["tags"] == tags and snap["is_sleeping"] == bool(tags), (snap, tags)
        assert snap["version"] == model.version, (snap["version"], model.version)
        want = model.admission_error()
        assert type(snap["admission"]) is (want or type(None)), (snap["admission"], want, model)
        text = model.admission_text()
        assert text is None or str(snap["admission"]) == text, (snap["admission"], text)
        assert not snap["problems"], snap["problems"]
        due = [r for r in d.requests if r.must_end and not r.done.is_set()]
        late = d.wait_ended(due)
        assert not late, f"requests a call ended got no terminal chunk: {late}"
        self.check_ended_requests()

    def check_ended_requests(self) -> None:
        for req in self.d.requests:
            if req.done.is_set() and not req.checked:
                check_outcome(req, self.reference, self.model.weight_sets)
                self.check_text(req)
                prompt = PROMPTS[req.prompt]
                check_sampling(
                    req, prompt, str(self.dir_a), self.logprobs_reference, self.model.weight_sets
                )
                req.checked = True

    def check_text(self, req: RequestModel) -> None:
        """A request that ended with "length" streamed the whole text of its tokens; one
        that a stop string ended, the text before it."""
        reason = req.chunks[-1].finish_reason if req.chunks else None
        by_stop_string = reason == "stop" and req.stop_text is not None
        if reason != "length" and not by_stop_string:
            return
        tokens = [t for c in req.chunks for t in c.token_ids]
        text = "".join(c.text for c in req.chunks)
        want = expected_text(str(self.dir_a), PROMPTS[req.prompt], tokens)
        if by_stop_string:
            want = want[: want.index(req.stop_text)]  # the stop string is not streamed
        assert text == want, (req.request_id, tokens, text, want)

    def check_every_request_ended(self) -> None:
        late = self.d.wait_ended(self.d.requests)
        assert not late, f"requests that never ended: {late}"
        self.check_ended_requests()

    def teardown(self) -> None:
        try:
            if self.driver is not None:
                self.finish_gracefully()
        finally:
            if self.driver is not None:
                self.driver.faults.release()
                if not self.driver.run_future.done():
                    self.portal.call(self.driver.engine.stop)
                    self.driver.run_future.exception(timeout=BOUND)
            self.portal.call(self.tg.cancel_scope.cancel)
            self.host.result(timeout=BOUND)
            self._portal_cm.__exit__(None, None, None)
        assert engine_threads() == []

    def finish_gracefully(self) -> None:
        """Let every held and frozen request run to its natural end (through the keep cycle,
        if the example made none), then stop."""
        if self.model.alive:
            if self.model.state is S.SLEEPING:
                self.wakeup(["weights", "kv_cache"])
            if self.model.state is S.PAUSED:
                self.resume()
            if self.model.state is S.RUNNING and not self.kept_cycle_done:
                self.keep_cycle(2, "B")  # random draws may miss it: once per example, with
                # whatever requests are still live
            for req in self.live():
                req.must_end = True
            self.check_engine()
            self.stop(0.0)
        self.check_every_request_ended()
        self.check_engine()


@pytest.fixture(scope="module")
def tiny_llama_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama with other random weights: the ``update_weights`` payload."""
    from model_factory import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-b"), arch="llama", seed=1)


ENGINE_KINDS = [
    pytest.param("uni", id="uni"),
    pytest.param(
        "mp",
        id="mp",
        marks=pytest.mark.skipif(not mp_executor_exists(), reason="no mp executor yet"),
    ),
    pytest.param("process", id="process"),
]


@pytest.mark.parametrize("kind", ENGINE_KINDS)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lifecycle_state_machine(
    backend: str, kind: str, tiny_llama_dir: Path, tiny_llama_dir_b: Path
) -> None:
    """The machine against one engine kind: in-process (``uni``), its model in a worker
    process (``mp``), the whole engine in its own process (``process``); the last two with
    fewer examples (each engine starts processes), and no process left behind."""
    examples = EXAMPLES if kind == "uni" else PROCESS_EXAMPLES
    run_machine(backend, kind, tiny_llama_dir, tiny_llama_dir_b, examples)


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Mistral whose every layer has a sliding window of ``WINDOW`` keys, and the
    same model with other random weights (its ``update_weights`` payload). Seeds 0 and 4:
    every greedy reference's top-1 logit leads by 0.002 or more (seed 1's came within
    0.0008 once, where a batched float32 step might flip it)."""
    from model_factory import make_tiny_model_dir

    return (
        make_tiny_model_dir(tmp_path_factory.mktemp("window-a"), "mistral", sliding_window=WINDOW),
        make_tiny_model_dir(
            tmp_path_factory.mktemp("window-b"), "mistral", seed=4, sliding_window=WINDOW
        ),
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_lifecycle_state_machine_sliding_window(
    backend: str, window_dirs: tuple[Path, Path]
) -> None:
    """The machine (``uni`` kind) over a sliding-window model: blocks behind a request's
    window go back to the pool while it runs. After every step each running request must
    have given back exactly those (the driver's window check), the block accounting and
    the prefix cache stay consistent around them, and every request's tokens still equal
    transformers' (which attends to the window only)."""
    run_machine(backend, "uni", *window_dirs, WINDOW_EXAMPLES)


def run_machine(backend: str, kind: str, dir_a: Path, dir_b: Path, examples: int) -> None:
    machine = type(
        "Machine",
        (LifecycleMachine,),
        {"dir_a": dir_a, "dir_b": dir_b, "backend": backend, "kind": kind},
    )
    children = child_pids()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=DERANDOMIZE,
            database=None if DERANDOMIZE else settings.default.database,
            suppress_health_check=list(HealthCheck),
            # shrinking restarts an engine per attempt: minutes; CI reports the raw example
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            + ([] if os.environ.get("CI") else [Phase.shrink]),
        ),
    )
    assert child_pids() <= children, "an engine left a process behind"
