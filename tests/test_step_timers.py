"""``CausalLM.timers``: the forward's time in products and in attention, on every path.

A speed figure is not a test: these check that the seam measures what it names (a product
made slower shows up in ``products_s``, an attention made slower in ``attention_s``), that it
changes no result, and that the one-call decode reports its inner kernels too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from test_model_fast_paths import _prefill_then_decode, _prompts
from tgengine.kernels import elementwise
from tgengine.models import causal_lm, load_model, load_model_config, self_attention
from tgengine.models.gemm import Gemm
from tgengine.models.step_timers import ForwardTimes
from tgengine.models.weights import pack_weights

from model_factory import make_tiny_model_dir

DELAY = 0.002


def _model(tmp_path: Path, dtype: torch.dtype, *, prepack: bool = False) -> Any:
    model_dir = make_tiny_model_dir(tmp_path / "llama", "llama", head_dim=32, num_hidden_layers=2)
    model = load_model(load_model_config(model_dir), model_dir, dtype, "cpu")
    model.gemm.prepack = prepack
    pack_weights(model)
    return model


def _slowed(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(owner, name)

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        time.sleep(DELAY)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)
    return calls


def test_the_layer_path_times_its_products_and_its_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path, torch.float32)
    prompts = _prompts(model.config.vocab_size, [5, 9, 2])
    want = _prefill_then_decode(model, [list(p) for p in prompts])
    products = _slowed(monkeypatch, Gemm, "_linear")
    attention = _slowed(monkeypatch, self_attention, "paged_attention")
    model.timers = timers = ForwardTimes()
    start = time.perf_counter()
    got = _prefill_then_decode(model, [list(p) for p in prompts])
    wall = time.perf_counter() - start
    assert torch.equal(got, want), "timing changes no result"
    # Two forwards of 2 layers: 4 products a layer and the head (whose float32 output takes
    # one more inner call here); one attention a layer.
    assert len(products) == 2 * (2 * 4 + 2) and len(attention) == 2 * 2
    assert timers.products_s >= len(products) * DELAY
    assert timers.attention_s >= len(attention) * DELAY
    assert timers.products_s + timers.attention_s < wall
    model.timers = None
    before = ForwardTimes(timers.products_s, timers.attention_s)
    _prefill_then_decode(model, [list(p) for p in prompts])
    assert timers == before, "with timers None nothing is added"


@pytest.mark.skipif(
    not elementwise.applies(torch.zeros(1, dtype=torch.bfloat16)),
    reason="no AVX2/FMA/F16C or no C++ compiler for tgengine's kernels",
)
def test_the_one_call_decode_reports_its_products_and_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path, torch.bfloat16, prepack=True)
    if not any(run is not None for _, _, run in model.decode_calls.segments()):
        pytest.skip("no one-call decode here: the weights are not panels (oneDNN on AVX-512)")
    prompts = _prompts(model.config.vocab_size, [5, 9, 2])
    want = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    spent: list[tuple[int, int]] = []
    original = causal_lm.run_layers

    def counted(*args: Any) -> Any:
        out = original(*args)
        ns = args[-1]
        spent.append((int(ns[0]), int(ns[1])))
        return out

    monkeypatch.setattr(causal_lm, "run_layers", counted)
    model.timers = timers = ForwardTimes()
    got = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    assert torch.equal(got, want), "timing changes no result"
    assert len(spent) == 1, "the decode step ran in one call"
    products_ns, attention_ns = spent[0]
    assert products_ns > 0 and attention_ns > 0
    # The prefill's products and attention are timed in Python; the decode's in the call.
    assert timers.products_s > products_ns * 1e-9 and timers.attention_s > attention_ns * 1e-9
