"""n, log probabilities, penalties and biases through the public Engine API."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import anyio
import pytest
import torch

from tgengine import InvalidRequestError, RequestOutput, SamplingParams, open_engine

from engine_helpers import TIMEOUT, _hf_model, collect, greedy, tiny_config, tokens_of

pytestmark = pytest.mark.anyio
PROMPT = "The quick brown fox jumps over the lazy dog."


def by_index(chunks: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    groups: dict[int, list[RequestOutput]] = defaultdict(list)
    for chunk in chunks:
        groups[chunk.index].append(chunk)
    return dict(groups)


async def test_n_sequences_share_the_prompt_and_reproduce_with_a_seed(
    tiny_llama_dir: Path,
) -> None:
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    prompt = list(range(3, 40))  # 37 tokens: 9 full blocks of 4
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            before = engine.stats()
            chunks = await collect(engine, prompt, params)
            after = engine.stats()
            again = await collect(engine, prompt, params)
            first_alone = await collect(
                engine, prompt, SamplingParams(**{**_fields(params), "n": 1})
            )
            greedy_n = await collect(engine, prompt, SamplingParams(n=2, **_fields(greedy(5))))
            greedy_1 = await collect(engine, prompt, greedy(5))
    groups = by_index(chunks)
    assert sorted(groups) == [0, 1, 2]
    for seq_chunks in groups.values():
        assert [c.finish_reason for c in seq_chunks] == [None] * 5 + ["length"]
        assert {c.request_id for c in seq_chunks} == {chunks[0].request_id}
    assert chunks[-1].finish_reason == "length"
    samples = [tokens_of(groups[i]) for i in range(3)]
    assert len({tuple(s) for s in samples}) > 1, "n sequences should differ"
    assert [tokens_of(by_index(again)[i]) for i in range(3)] == samples
    assert tokens_of(first_alone) == samples[0]  # sequence i uses seed + i
    # The prompt was computed once: the other two found its 9 full blocks cached.
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    assert hits == 2 * 36
    assert after.prompt_tokens_total - before.prompt_tokens_total == 37
    g = by_index(greedy_n)
    assert tokens_of(g[0]) == tokens_of(g[1]) == tokens_of(greedy_1)


def _fields(params: SamplingParams) -> dict[str, object]:
    return {k: getattr(params, k) for k in ("max_tokens", "temperature", "seed", "ignore_eos")}


async def test_logprobs_and_prompt_logprobs_match_the_reference_model(
    tiny_llama_dir: Path,
) -> None:
    prompt = [5, 17, 29, 3, 44, 8, 61, 12, 9, 30]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir, max_num_batched_tokens=4)) as engine:
            chunks = await collect(engine, prompt, params)
            with_prompt = await collect(
                engine, prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
            )
            zero = await collect(engine, prompt, SamplingParams(max_tokens=2, logprobs=0))
    tokens = tokens_of(chunks)
    with torch.inference_mode():
        logits = _hf_model(str(tiny_llama_dir))(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, chunk in enumerate(chunks):
        row = reference[len(prompt) - 1 + i]
        assert chunk.logprobs is not None and chunk.top_logprobs is not None
        assert chunk.logprobs[0] == pytest.approx(row[tokens[i]].item(), abs=1e-4)
        top = chunk.top_logprobs[0]
        assert list(top) == row.topk(3).indices.tolist()
        assert next(iter(top)) == tokens[i]  # greedy picks the most likely
    first = with_prompt[0]
    assert first.prompt_logprobs is not None and first.prompt_top_logprobs is not None
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):  # computed over chunks of 4 tokens
        want = reference[pos - 1, prompt[pos]].item()
        assert first.prompt_logprobs[pos] == pytest.approx(want, abs=1e-4)
        assert len(first.prompt_top_logprobs[pos] or {}) == 2
    assert all(c.prompt_logprobs is None for c in with_prompt[1:] + chunks)
    assert [c.top_logprobs for c in zero if c.token_ids] == [[{}], [{}]]
    assert all(c.logprobs for c in zero if c.token_ids)


async def test_bias_min_tokens_and_penalties_change_what_is_generated(
    tiny_llama_dir: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(tiny_llama_dir)) as engine:
            free = tokens_of(await collect(engine, PROMPT, greedy(12)))
            biased = tokens_of(
                await collect(
                    engine, PROMPT, SamplingParams(**_fields(greedy(6)), logit_bias={77: 100})
                )
            )
            stop = free[0]
            held = tokens_of(
                await collect(
                    engine,
                    PROMPT,
                    SamplingParams(
                        max_tokens=12, temperature=0, stop_token_ids=(stop,), min_tokens=3
                    ),
                )
            )
            repeats = [7] * 20  # greedy on the random model repeats itself after this
            looping = tokens_of(await collect(engine, repeats, greedy(30)))
            penalised = [
                tokens_of(
                    await collect(engine, repeats, SamplingParams(**_fields(greedy(30)), **penalty))
                )
                for penalty in (
                    {"frequency_penalty": 2.0},
                    {"presence_penalty": 2.0},
                    {"repetition_penalty": 2.0},
                )
            ]
            vocab = engine.model_config.vocab_size
            with pytest.raises(InvalidRequestError) as bad_bias:
                engine.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
            with pytest.raises(InvalidRequestError) as bad_stop:
                engine.generate(PROMPT, SamplingParams(stop_token_ids=(vocab + 5,)))
    assert biased == [77] * 6
    assert stop not in held[:3] and len(held) >= 3
    assert len(set(looping)) < 25
    assert [len(set(tokens)) for tokens in penalised] == [30, 30, 30]
    assert bad_bias.value.field == "logit_bias" and str(vocab) in str(bad_bias.value)
    assert bad_stop.value.field == "stop_token_ids" and str(vocab + 5) in str(bad_stop.value)
