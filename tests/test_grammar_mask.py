"""The grammar matcher and the batched mask, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tgengine import StructuredOutputsParams
from tgengine.structured_outputs.bitmasks import BitmaskJob, bitmask_words, fill_bitmasks
from tgengine.structured_outputs.compiler import GrammarCompiler
from tgengine.structured_outputs.grammar_mask import (
    allowed_tokens_numpy,
    allowed_tokens_torch,
    apply_token_bitmask_,
)

from model_factory import make_tokenizer


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    tokenizer = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return GrammarCompiler(tokenizer, len(tokenizer) + 5, [tokenizer.eos_token_id])


def test_mask_unpacks_the_same_on_numpy_and_torch() -> None:
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, bitmask_words(70)), dtype=np.int32)
    want = [[bool(row[t // 32] >> (t % 32) & 1) for t in range(70)] for row in bitmask]
    assert allowed_tokens_numpy(bitmask, 70).tolist() == want
    assert allowed_tokens_torch(bitmask, 70, torch.device("cpu")).tolist() == want
    logits = torch.zeros(3, 70)
    apply_token_bitmask_(logits, bitmask)
    assert (logits == 0).tolist() == want
    assert torch.isinf(logits[~torch.tensor(want)]).all()


def test_matcher_replays_after_a_restart(compiler: GrammarCompiler) -> None:
    """A matcher that falls behind, or is ahead of a shorter sequence, catches up by replay."""
    tokenizer_ids = compiler.ll_tokenizer.tokenize_str('{"a":[1,2]}')
    params = StructuredOutputsParams(json={"type": "object"})
    steady, fresh = compiler.matcher(params), compiler.matcher(params)
    for n in range(len(tokenizer_ids)):
        steady.sync(tokenizer_ids[:n])
    fresh.sync(tokenizer_ids)  # ahead of a shorter sequence: starts over
    fresh.sync(tokenizer_ids[: len(tokenizer_ids) - 1])
    assert fresh.num_consumed == steady.num_consumed == len(tokenizer_ids) - 1
    words = bitmask_words(compiler.vocab_size)
    masks = [np.zeros((1, words), dtype=np.int32) for _ in range(2)]
    steady.fill_bitmask(masks[0], 0)
    fresh.fill_bitmask(masks[1], 0)
    assert np.array_equal(masks[0], masks[1])
    assert masks[0].any()


def test_a_rejected_token_is_an_error_for_its_sequence_only(compiler: GrammarCompiler) -> None:
    choice = StructuredOutputsParams(choice=("yes", "no"))
    bad = compiler.ll_tokenizer.tokenize_str("maybe")
    jobs = [
        BitmaskJob("good", compiler.matcher(choice), []),
        BitmaskJob("bad", compiler.matcher(choice), bad),
    ]
    filled = fill_bitmasks(jobs, compiler.vocab_size)
    assert list(filled.errors) == ["bad"] and "rejected by the grammar" in filled.errors["bad"]
    allowed = allowed_tokens_numpy(filled.bitmask, compiler.vocab_size)[0]
    yes = compiler.ll_tokenizer.tokenize_str("yes")[0]
    assert allowed[yes] and allowed.sum() < compiler.vocab_size // 4
    assert not allowed[compiler.vocab_size - 1]  # padding past the tokenizer is never allowed
