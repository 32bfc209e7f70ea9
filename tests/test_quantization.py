"""int8 weight-only quantization (``quantization="int8"``): the kernel computes the product of
the dequantized weight, every linear weight of a model is quantized (the tied embedding
included) and stays the only copy through updates and sleep, and the engine refuses what it
cannot run."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
import torch.nn.functional as F

from test_lifecycle import PROMPTS, checkpoint_bytes, other_weights, weights_bytes
from test_model_fast_paths import _prefill_then_decode, _prompts
from tgengine import EngineConfig, EngineDeadError, ModelLoadError, kernels, open_engine
from tgengine.models import iter_safetensors, load_model, load_model_config
from tgengine.models.gemm import Panels, can_pack_panels
from tgengine.models.weights import copy_weights, pack_weights

from engine_helpers import TIMEOUT, generate_all, greedy, tiny_config, tokens_of

HALF = [torch.bfloat16, torch.float16]
needs_kernels = pytest.mark.skipif(
    not can_pack_panels(torch.bfloat16), reason="no AVX2/FMA/F16C or no C++ compiler"
)


def test_quantize_rounds_each_row_to_its_own_scale() -> None:
    torch.manual_seed(0)
    weight = torch.randn(37, 24) * torch.logspace(-3, 1, 37)[:, None]
    weight[5] = 0.0  # an all-zero row quantizes to zeros
    panels, scales = kernels.quantize_panels(weight)
    assert panels.dtype == torch.int8 and panels.shape == (3, 24, kernels.PANEL)
    assert scales.shape == (48,) and torch.all(scales[37:] == 0)
    back = kernels.dequantize_rows(panels, scales, torch.arange(37))
    # Each value within half a step of its row's scale; each row's largest value exact.
    assert torch.all((back - weight).abs() <= scales[:37, None] / 2 + 1e-6)
    peak = weight.abs().argmax(dim=1)
    rows = torch.arange(37)
    torch.testing.assert_close(back[rows, peak], weight[rows, peak])
    assert torch.all(back[5] == 0)
    assert int(panels.abs().max()) == kernels.INT8_MAX


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("n", "k"), [(96, 64), (37, 24), (100, 40)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13])
def test_int8_panels_compute_the_dequantized_product(
    dtype: torch.dtype, n: int, k: int, m: int
) -> None:
    torch.manual_seed(n * 100 + m)
    panels, scales = kernels.quantize_panels(torch.randn(n, k))
    dequantized = kernels.dequantize_rows(panels, scales, torch.arange(n))
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    got = kernels.panel_linear(x, panels, n, bias, scales=scales)
    want = F.linear(x.float(), dequantized, bias.float())
    assert got.dtype == dtype
    # Summed in float32 and rounded once: within a unit of the dtype's last place or two.
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0.02, atol=0.02)
    logits = kernels.panel_linear(x, panels, n, bias, scales=scales, float_output=True)
    assert logits.dtype == torch.float32 and torch.equal(logits, got.float())


@needs_kernels
def test_a_model_quantizes_every_linear_weight_and_the_tied_embedding(
    tiny_qwen2_dir: Path,
) -> None:
    config = load_model_config(tiny_qwen2_dir)
    assert config.tie_word_embeddings
    plain = load_model(config, tiny_qwen2_dir, torch.bfloat16, "cpu")
    model = load_model(config, tiny_qwen2_dir, torch.bfloat16, "cpu")
    model.gemm.prepack = True
    model.gemm.quantization = "int8"
    pack_weights(model)
    linears = list(model.linear_weights())
    assert linears and all(
        isinstance(w.packed, Panels) and w.packed.data.dtype == torch.int8 for w in linears
    )
    halves = sum(p.numel() * 2 for weights in linears for p in weights.params)
    assert halves / 2 <= model.gemm.packed_bytes <= halves * 0.6, "about one byte a weight"
    ids = torch.tensor([0, 1, 15, 16, config.vocab_size - 1])
    embed = model.model.embed_tokens
    want_rows = plain.model.embed_tokens.weight[ids].float()
    got_rows = embed(ids).float()
    assert embed(ids).dtype == torch.bfloat16
    torch.testing.assert_close(got_rows, want_rows, atol=0.02, rtol=0.02)
    prompts = _prompts(config.vocab_size, [5, 9, 2])
    got = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    want = _prefill_then_decode(plain, [list(p) for p in prompts], torch.bfloat16)
    # Random tiny weights: the int8 error shows, but the logits stay close to bf16's.
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()


def test_the_config_refuses_what_int8_cannot_be() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prepack_weights"):
        EngineConfig(model="m", quantization="int8", prepack_weights=False)


@pytest.mark.anyio
async def test_a_float32_model_is_refused_at_start(tiny_llama_dir: Path) -> None:
    config = tiny_config(tiny_llama_dir, quantization="int8")  # float32
    with anyio.fail_after(TIMEOUT), pytest.raises(EngineDeadError, match="int8") as raised:
        async with open_engine(config):
            pass
    assert isinstance(raised.value.__cause__, ModelLoadError)


@needs_kernels
@pytest.mark.anyio
async def test_int8_weights_are_one_copy_and_follow_updates_and_sleep(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    named, other_dir = other_weights(tmp_path)
    original = [(name, t.to(torch.bfloat16)) for name, t in iter_safetensors(tiny_llama_dir)]
    int8 = {"dtype": "bfloat16", "quantization": "int8"}
    halves = checkpoint_bytes(original, torch.bfloat16)
    linear_elements = sum(
        t.numel() for n, t in original if n.endswith(("proj.weight", "head.weight"))
    )
    prompts, params = PROMPTS[:4], greedy(12)
    with anyio.fail_after(TIMEOUT):
        async with open_engine(tiny_config(other_dir, **int8)) as reference:
            want = [tokens_of(r) for r in await generate_all(reference, prompts, params)]
        async with open_engine(tiny_config(tiny_llama_dir, **int8)) as engine:
            before = [tokens_of(r) for r in await generate_all(engine, prompts, params)]
            # The linear weights in one byte each (+ a scale per row); the rest stays bf16.
            size = weights_bytes(engine)
            assert halves - linear_elements <= size <= (halves - linear_elements) * 1.05
            await engine.update_weights([(n, t.to(torch.bfloat16)) for n, t in named])
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == want
            assert want != before
            assert weights_bytes(engine) == size
            await engine.sleep(1)
            await engine.wakeup()
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == want
            await engine.sleep(2)
            await engine.wakeup()  # the original weights from disk, quantized again
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == before
            await engine.update_weights(original)
            assert [tokens_of(r) for r in await generate_all(engine, prompts, params)] == before
            assert weights_bytes(engine) == size


def test_the_bench_counts_a_byte_per_int8_matrix_weight(tiny_llama_dir: Path) -> None:
    from tgengine.bench.roofline import ModelCosts

    config = load_model_config(tiny_llama_dir)
    plain = ModelCosts.of(config, torch.bfloat16)
    int8 = ModelCosts.of(config, torch.bfloat16, "int8")
    matrices = plain.layer_matmul_params + plain.head_params
    assert plain.weight_bytes - int8.weight_bytes == matrices  # 2 bytes each -> 1
    assert int8.flops_per_token() == plain.flops_per_token()


@needs_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_a_partial_update_leaves_the_other_rows_bits_alone(
    dtype: torch.dtype, tiny_llama_dir: Path
) -> None:
    # Writing k_proj unpacks q/k/v (dequantized), writes k and quantizes all three again:
    # q's and v's int8 values and scales come back bit for bit.
    config = load_model_config(tiny_llama_dir)
    model = load_model(config, tiny_llama_dir, dtype, "cpu")
    model.gemm.prepack = True
    model.gemm.quantization = "int8"
    pack_weights(model)
    qkv = model.model.layers[0].self_attn.qkv
    before = qkv.packed
    assert isinstance(before, Panels) and before.scales is not None
    q_rows, k_rows = (int(p.shape[0]) for p in qkv.params[:2])
    name = "model.layers.0.self_attn.k_proj.weight"
    new_k = torch.randn(k_rows, config.hidden_size).to(dtype)
    copy_weights(model, [(name, new_k)])
    after = qkv.packed
    assert isinstance(after, Panels) and after.scales is not None
    rows = torch.arange(before.rows)
    kept = (rows < q_rows) | (rows >= q_rows + k_rows)
    old_q = kernels.dequantize_rows(before.data, before.scales, rows[kept])
    new_q = kernels.dequantize_rows(after.data, after.scales, rows[kept])
    assert torch.equal(old_q, new_q)
    written = kernels.dequantize_rows(after.data, after.scales, rows[~kept])
    assert not torch.equal(
        written, kernels.dequantize_rows(before.data, before.scales, rows[~kept])
    )
