"""The lifecycle machine's sampling features: structured outputs, log probabilities, seeds.

References are computed once per weight set with transformers: greedy tokens under a
constraint (the grammar's allowed tokens, read from the matcher's bitmask, applied to
transformers' logits); the log probabilities of every prompt token and every greedy
token; the tokens of a seeded sampled request (the sampler's exponential race, its noise
drawn from a generator seeded with the sequence's seed). ``check_sampling`` holds an
ended request's chunks against them: a constrained request's tokens all fit its grammar
and a complete one's text matches the constraint; a request that asked for log
probabilities has one per token (the greedy token the most likely), its prompt's once,
with its first token, and, where the weights it ran on are known, both equal
transformers'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tgengine import RequestOutput, StructuredOutputsParams
from tgengine.models.config_loader import load_model_config
from tgengine.structured_outputs.bitmasks import bitmask_words
from tgengine.structured_outputs.compiler import GrammarCompiler
from tgengine.structured_outputs.matcher import GrammarMatcher, GrammarRejectedError

from engine_helpers import _hf_model
from lifecycle_model import RequestModel, chunks_before_change
from structured_helpers import CASES, check_output

CONSTRAINTS = ("choice", "regex")  # short, bounded outputs a random tiny model completes
LOGPROBS = 2  # alternatives per generated token
PROMPT_LOGPROBS = 1
TOLERANCE = 1e-3  # float32, batched and chunked differently from transformers
GRAMMAR_FAULT = "injected fault"
# a constrained reference whose top two allowed logits come closer than this somewhere is
# not used (batching may flip such a near-tie); the free prompts' margins are >= 0.0025
MIN_MARGIN = 0.002


def grammar_error_text() -> str:
    """The error of a request whose grammar rejects its tokens (``RejectingMatcher``)."""
    return f"structured output: token -1 rejected by the grammar: {GRAMMAR_FAULT}"


@functools.lru_cache(maxsize=1)
def eos_ids(model_dir: str) -> frozenset[int]:
    return frozenset(load_model_config(model_dir).eos_token_ids)


@functools.lru_cache(maxsize=4)
def _compiler(model_dir: str) -> GrammarCompiler:
    from transformers import AutoTokenizer

    config = load_model_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)


def matcher(model_dir: str, kind: str) -> GrammarMatcher:
    """A fresh matcher for ``CASES[kind]`` (every model directory here has one tokenizer)."""
    return _compiler(model_dir).matcher(StructuredOutputsParams(**CASES[kind]))


def allowed(bitmask: npt.NDArray[np.int32], vocab_size: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.view(np.uint8), count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.astype(bool))


def constrained_greedy(
    model_dir: str, prompt: list[int], kind: str, max_new: int
) -> list[int] | None:
    """transformers' greedy tokens under ``CASES[kind]``, up to and with the EOS that ends
    it; None where two allowed tokens come within ``MIN_MARGIN`` (no reliable reference)."""
    model, grammar = _hf_model(model_dir), matcher(model_dir, kind)
    vocab_size = load_model_config(model_dir).vocab_size
    bitmask = np.zeros((1, bitmask_words(vocab_size)), dtype=np.int32)
    tokens: list[int] = []
    while len(tokens) < max_new and (not tokens or tokens[-1] not in eos_ids(model_dir)):
        grammar.sync(tokens)
        grammar.fill_bitmask(bitmask, 0)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1, :vocab_size].float()
            logits = logits.masked_fill(~allowed(bitmask[0], vocab_size), float("-inf"))
        best, second = logits.topk(2).values.tolist()
        if best - second < MIN_MARGIN:
            return None
        tokens.append(int(logits.argmax()))
    return tokens


def sampled_reference(
    model_dir: str, prompt: list[int], seed: int, temperature: float, max_new: int
) -> list[int] | None:
    """The tokens a request sampled at ``temperature`` with ``seed`` must get (sequence
    ``i`` of an ``n > 1`` request: ``seed + i``; docs/sampling.md): the sampler's exponential
    race (``sampler.py``: ``argmax(x - log q)``, ``x`` the logits scaled by the temperature
    after subtracting their max, ``q = -log u`` with ``u`` uniform, one draw per vocabulary
    entry and token, from a CPU generator seeded with ``seed``) over transformers' logits.
    None where the top two scores come within ``MIN_MARGIN`` (no reliable reference)."""
    model = _hf_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            scaled = (logits - logits.max()) / torch.tensor([temperature])
            noise = torch.empty(logits.shape[0]).uniform_(generator=generator)
            scores = scaled - noise.log_().neg_().log_()
            best, second = scores.topk(2).values.tolist()
            if best - second < MIN_MARGIN:
                return None
            tokens.append(int(scores.argmax()))
    return tokens


@dataclass
class LogprobReference:
    """transformers' log probabilities along one prompt and its greedy continuation."""

    prompt: list[float | None]  # of each prompt token (the first has none)
    rows: torch.Tensor  # [MAX_TOKENS, vocab]: the distribution of each generated token


def logprob_reference(model_dir: str, prompt: list[int], greedy: list[int]) -> LogprobReference:
    with torch.inference_mode():
        logits = _hf_model(model_dir)(torch.tensor([prompt + greedy])).logits[0]
    table = torch.log_softmax(logits.float(), dim=-1)
    values: list[float | None] = [None]
    values += [float(table[pos - 1, prompt[pos]]) for pos in range(1, len(prompt))]
    return LogprobReference(values, table[len(prompt) - 1 :])


class RejectingMatcher(GrammarMatcher):
    """A matcher whose grammar rejects the next token: what ``fill_bitmasks`` reports when
    a sampled token escaped the mask (only a bug does that; here, an injected fault)."""

    def __init__(self, inner: GrammarMatcher) -> None:
        super().__init__(inner._matcher)
        self.num_consumed = inner.num_consumed

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        raise GrammarRejectedError(-1, GRAMMAR_FAULT)


async def reject_grammar(engine: Any, request_id: str) -> bool:
    """From its next step on, ``request_id``'s grammar rejects its tokens; False if it has
    ended or is not constrained (the engine's internals: in-process kinds only).

    Between two steps, under the loop's step lock: a step's bitmask thread may be bringing
    the matcher up to date, and the rejecting matcher shares its grammar state but copies
    its count of consumed tokens (taken while that thread consumed a token, the count is
    one short: the next step replays that token into the shared state, which rejects it
    with a parser error instead of the injected fault)."""
    async with engine._loop.between_steps():
        tracker = engine._loop.tracker
        request = tracker.get(request_id) if tracker is not None else None
        if request is None or request.grammar is None:
            return False
        request.grammar = RejectingMatcher(request.grammar)
        return True


def check_sampling(
    req: RequestModel,
    prompt: list[int],
    model_dir: str,
    logprobs: dict[str, dict[int, LogprobReference]],
    weight_sets: dict[int, str],
) -> None:
    """``req``'s structured output and log probabilities, beside ``check_outcome``
    (``weight_sets`` as there: only the chunks computed before the weights changed under
    it have the reference's log probabilities)."""
    if req.constraint is not None:
        check_constrained(req, model_dir)
    if req.logprobs:
        ref = logprobs[req.weights][req.prompt] if req.weights is not None else None
        check_logprobs(req, prompt, ref, chunks_before_change(req, weight_sets))


def check_constrained(req: RequestModel, model_dir: str) -> None:
    """Every token fits the grammar; a request that ended with "stop" completed it."""
    assert req.constraint is not None
    tokens = [t for c in req.chunks for t in c.token_ids]
    grammar = matcher(model_dir, req.constraint)
    try:
        grammar.sync(tokens)
    except GrammarRejectedError as exc:
        raise AssertionError(f"{req.request_id}: {tokens} do not fit {req.constraint}") from exc
    if req.chunks and req.chunks[-1].finish_reason == "stop":
        assert tokens[-1] in eos_ids(model_dir) and grammar.is_stopped, (req.request_id, tokens)
        check_output(req.constraint, "".join(c.text for c in req.chunks))


def check_logprobs(
    req: RequestModel, prompt: list[int], ref: LogprobReference | None, natural_chunks: int
) -> None:
    """One log probability per token (greedy: the most likely of its ``LOGPROBS``), the
    prompt's with the first token only; equal to ``ref``'s where the weights are known: in
    the first ``natural_chunks`` chunks (those the weights it was admitted with computed)."""
    where = req.request_id
    with_tokens = [(n, c) for n, c in enumerate(req.chunks) if c.token_ids]
    for i, (n, chunk) in enumerate(with_tokens):
        known = ref if n < natural_chunks else None  # computed with the admission weights
        token = chunk.token_ids[0]
        assert chunk.logprobs is not None and chunk.top_logprobs is not None, (where, chunk)
        top = chunk.top_logprobs[0]
        assert len(chunk.logprobs) == 1 and len(top) == LOGPROBS, (where, chunk)
        assert next(iter(top)) == token and top[token] == chunk.logprobs[0], (where, chunk)
        if known is not None:
            for alternative, value in top.items():
                want = float(known.rows[i, alternative])
                assert abs(value - want) <= TOLERANCE, (where, i, alternative, value, want)
        check_prompt_logprobs(req, chunk, prompt, known if i == 0 else None, first=i == 0)
    for chunk in req.chunks:
        if not chunk.token_ids:
            assert chunk.logprobs is None and chunk.prompt_logprobs is None, (where, chunk)


def check_prompt_logprobs(
    req: RequestModel,
    chunk: RequestOutput,
    prompt: list[int],
    ref: LogprobReference | None,
    *,
    first: bool,
) -> None:
    where = req.request_id
    if not first:
        assert chunk.prompt_logprobs is None and chunk.prompt_top_logprobs is None, (where, chunk)
        return
    values, tops = chunk.prompt_logprobs, chunk.prompt_top_logprobs
    assert values is not None and tops is not None, (where, chunk)
    assert len(values) == len(tops) == len(prompt), (where, values)
    assert values[0] is None and tops[0] is None, (where, values)
    for pos in range(1, len(prompt)):
        value, top = values[pos], tops[pos]
        assert value is not None and top is not None and len(top) == PROMPT_LOGPROBS, (where, pos)
        if ref is not None:
            want = ref.prompt[pos]
            assert want is not None and abs(value - want) <= TOLERANCE, (where, pos, value, want)
