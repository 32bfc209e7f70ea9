"""The fused element-wise kernels give the torch path's results (``kernels.elementwise``).

Each is compared with the torch ops it replaces, in bf16 and fp16: rotary + KV store to the
bit, the norm and the activation to the last bit of their dtype (the order of a sum, the
last bit of ``exp``); and a model's logits with them on and off.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from test_model_fast_paths import _prefill_then_decode, _prompts, assert_same_argmax
from tgengine import kernels
from tgengine.kernels import elementwise
from tgengine.kernels.decode_layer import DecodeStep, LayerRun
from tgengine.models import CausalLM, causal_lm, fused_decode, load_model, load_model_config
from tgengine.models.attention import write_kv
from tgengine.models.decoder_layer import DecoderLayer
from tgengine.models.gemm import can_pack_pairs, can_pack_panels, can_prepack
from tgengine.models.layers import RMSNorm, activation
from tgengine.models.loader import iter_stored, load_weights
from tgengine.models.rope import apply_rotary
from tgengine.models.weights import copy_weights, drop_packed, pack_weights

from kernel_helpers import avx512_bf16
from model_factory import make_tiny_model_dir

pytestmark = pytest.mark.skipif(
    not elementwise.applies(torch.zeros(1, dtype=torch.bfloat16)),
    reason="no AVX2/FMA/F16C or no C++ compiler for tgengine's kernels",
)
HALF = [torch.bfloat16, torch.float16]


HALF_LOGITS = {"atol": 0.08, "rtol": 0.05}
"""Half-precision logits of kernels that sum in another order than torch's: the activations
round to bf16 at every layer, so a logit near zero may be off by a few bf16 ulps of the
logits' scale (2 to 4 here: 0.016 to 0.03 an ulp)."""


def _ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for one unit in the last place of the dtype (a tiny absolute slack near 0)."""
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("size", [64, 576, 37])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_matches_the_residual_add_and_the_norm(
    dtype: torch.dtype, size: int, rows: int, unit_offset: bool
) -> None:
    torch.manual_seed(rows + size)
    norm = RMSNorm(size, 1e-5, unit_offset=unit_offset)
    norm.weight.data = torch.randn(size).to(dtype)
    x = (torch.randn(rows, size) * 3).to(dtype)
    residual = torch.randn(rows, size).to(dtype)
    with torch.inference_mode():
        want_sum = residual + x
        want = norm(want_sum)
        mine = residual.clone()
        got, got_sum = norm.add_and_norm(x, mine, fused=True)
        assert got_sum is mine, "the sum is written into the residual in place"
        assert torch.equal(got_sum, want_sum), "the add rounds as torch's"
        _ulps(got, want)
        alone, same = norm.add_and_norm(x, None, fused=True)
        assert same is x
        _ulps(alone, norm(x))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(9, 3, 64, 64), (4, 2, 64, 32), (2, 1, 20, 20), (4, 4, 128, 128)],
)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_rope_store_kv_matches_apply_rotary_and_write_kv(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rows: int
) -> None:
    torch.manual_seed(rows)
    heads = num_heads + 2 * num_kv_heads
    qkv = torch.randn(rows, heads, head_dim).to(dtype)
    angles = torch.rand(rows, rotary_dim // 2) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    num_blocks, block_size = 64, 8
    slots = torch.randperm(num_blocks * block_size)[:rows]
    want_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).to(dtype)
    got_cache = want_cache.clone()
    qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], cos, sin)
    write_kv(want_cache, slots, qk[:, num_heads:], qkv[:, num_heads + num_kv_heads :])
    got = qkv.clone()
    elementwise.rope_store_kv(got, num_heads, cos, sin, got_cache, slots)
    assert torch.equal(got[:, : num_heads + num_kv_heads], qk), "rotated in place, to the bit"
    assert torch.equal(got[:, num_heads + num_kv_heads :], qkv[:, num_heads + num_kv_heads :])
    assert torch.equal(got_cache, want_cache), "keys and values stored at their slots only"


def test_rope_store_kv_refuses_a_slot_outside_the_cache() -> None:
    qkv = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    cos = sin = torch.zeros(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="refused"):
        elementwise.rope_store_kv(qkv, 1, cos, sin, cache, torch.tensor([0, 32]))
    assert not cache.any(), "nothing written when one slot is out of range"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # NaN's bits compare too


# 32 x 576: a decode step's norm, threaded from 8,192 elements on (the plain form: 32,768)
@pytest.mark.parametrize(
    ("rows", "size"), [(1, 576), (5, 72), (32, 576), (300, 576), (3, 37), (2, 24)]
)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_gives_the_same_bits_with_and_without_avx512_bf16(
    rows: int, size: int, unit_offset: bool
) -> None:
    # elementwise_avx512.cpp's 16-lane form (8-lane and scalar tails: sizes 72, 37, 24) sums
    # the squares in the 8-lane form's order: the same bits, NaN and all.
    torch.manual_seed(rows * size)
    weight = torch.randn(size).bfloat16()
    x = (torch.randn(rows, size) * 3).bfloat16()
    x[0, 1] = float("nan")
    residual = torch.randn(rows, size).bfloat16()
    outs = []
    for on in (True, False):
        with avx512_bf16(on):
            mine = residual.clone()
            got = elementwise.add_rms_norm(x.clone(), mine, weight, 1e-5, unit_offset=unit_offset)
            alone = elementwise.add_rms_norm(
                x[1:].clone(), None, weight, 1e-5, unit_offset=unit_offset
            )
            outs.append((got, mine, alone))
    for fast, plain in zip(outs[0], outs[1], strict=True):
        assert torch.equal(_bits(fast), _bits(plain))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(9, 3, 64, 64), (4, 2, 64, 32), (2, 1, 20, 20), (4, 4, 128, 80)],
)
@pytest.mark.parametrize("rows", [1, 40])
def test_rope_store_kv_gives_the_same_bits_with_and_without_avx512_bf16(
    num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rows: int
) -> None:
    # Rotated halves of a multiple of 16 take the 16-lane form; others (10, 40: not) the
    # 8-lane or scalar one.
    torch.manual_seed(rows + head_dim)
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim).bfloat16()
    angles = torch.rand(rows, rotary_dim // 2) * 100
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16()
    slots = torch.randperm(64 * 8)[:rows]
    caches, rotated = [], []
    for on in (True, False):
        cache = torch.zeros(2, num_kv_heads, 64, 8, head_dim, dtype=torch.bfloat16)
        got = qkv.clone()
        with avx512_bf16(on):
            elementwise.rope_store_kv(got, num_heads, cos, sin, cache, slots)
        caches.append(cache)
        rotated.append(got)
    assert torch.equal(_bits(rotated[0]), _bits(rotated[1]))
    assert torch.equal(_bits(caches[0]), _bits(caches[1]))


@pytest.mark.parametrize("act", sorted(elementwise.ACTIVATIONS))
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (32, 1536), (3, 100), (2, 1032)])
def test_act_mul_gives_the_same_bits_with_and_without_avx512_bf16(
    act: str, rows: int, inter: int
) -> None:
    torch.manual_seed(inter + rows)
    gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
    gate_up[0, :9] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-3, -1e-3, 30.0, -30.0, torch.nan])
    outs = []
    for on in (True, False):
        with avx512_bf16(on):
            outs.append(elementwise.act_mul(gate_up, act))
    assert torch.equal(_bits(outs[0]), _bits(outs[1]))


def _exact(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` in float64, rounded where torch's half-precision ops round."""
    x = gate.double()
    if act == "silu":
        y = x / (1 + torch.exp(-x))
    else:
        y = 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))
    return (y.to(gate.dtype).double() * up.double()).to(gate.dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("act", sorted(elementwise.ACTIVATIONS))
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 100), (64, 1024)])
def test_act_mul_matches_the_activation_times_up(
    dtype: torch.dtype, act: str, rows: int, inter: int
) -> None:
    torch.manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-3, -1e-3, 30.0, -30.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got = elementwise.act_mul(gate_up, act).double()
    want = (activation(act, gate) * up).double()
    exact = _exact(act, gate, up).double()
    # Within one unit in the last place of the exact value, or no farther from it than
    # torch's own result (gelu's 1 + tanh(y) cancels where y << 0; the kernel does not).
    ulp = exact.abs() * torch.finfo(dtype).eps + 1e-12
    assert ((got - exact).abs() <= torch.maximum(ulp, (want - exact).abs())).all()
    if act == "silu":
        _ulps(got, want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("model", "lengths"),
    [
        ("tiny_llama_dir", [5, 9, 2, 1]),
        ("tiny_qwen2_dir", [5, 9, 2, 1]),
        # head_dim 32, which the attention kernels take: prompts across key tiles, a window.
        ("llama", [40, 9, 2, 1]),
        ("mistral", [70, 33, 2, 1]),
    ],
)
def test_a_model_gives_the_same_logits_with_the_kernels_on_and_off(
    dtype: torch.dtype,
    model: str,
    lengths: list[int],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if model.startswith("tiny_"):
        model_dir: Path = request.getfixturevalue(model)
    else:
        window = {"sliding_window": 6} if model == "mistral" else {}
        model_dir = make_tiny_model_dir(tmp_path, model, head_dim=32, **window)
    config = load_model_config(model_dir)
    fast = load_model(config, model_dir, dtype, "cpu")
    fast.gemm.prepack = True
    pack_weights(fast)
    plain = load_model(config, model_dir, dtype, "cpu")
    plain.use_kernels = False
    calls: list[str] = []
    for module, name in [
        (elementwise, "add_rms_norm"),
        (elementwise, "rope_store_kv"),
        (elementwise, "act_mul"),
        (kernels, "paged_prefill"),
    ]:
        original = getattr(module, name)

        def counted(*args: object, _f: object = original, _n: str = name, **kw: object) -> object:
            calls.append(_n)
            return _f(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(module, name, counted)
    prompts = _prompts(config.vocab_size, lengths)
    got = _prefill_then_decode(fast, [list(p) for p in prompts], dtype)
    kernel = {"paged_prefill"} if config.head_dim == 32 else set()
    assert set(calls) == {"add_rms_norm", "rope_store_kv", "act_mul", *kernel}, "fused path ran"
    calls.clear()
    want = _prefill_then_decode(plain, [list(p) for p in prompts], dtype)
    assert not calls, "use_kernels=False is the torch path"
    torch.testing.assert_close(got, want, **HALF_LOGITS)
    assert_same_argmax(got, want, 2 * HALF_LOGITS["atol"])


def _isa() -> str:
    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture
def without_avx512_bf16() -> Iterator[None]:
    with avx512_bf16(False):
        yield


ONE_CALL_FORMS = ("panels", "int8", "pairs")
"""``Gemm.packed_form``'s answers that the one-call decode reads (``Panels``)."""


def _skip_unless_panels(model: CausalLM, dtype: torch.dtype) -> None:
    """Skip where ``pack_weights`` would not give the layers tgengine's panels, which the
    one-call decode reads (``Gemm.packed_form``: the same predicate ``pack`` follows)."""
    form = model.gemm.packed_form(dtype)
    if form not in ONE_CALL_FORMS:
        pytest.skip(
            f"{dtype} weights pack as {form!r} on this CPU ({_isa()}; oneDNN where it has "
            "AVX-512 without pair panels): the one-call decode reads tgengine's panels"
        )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases, a tied head
        ("mistral", {"sliding_window": 6}),
    ],
)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_decode_step_in_one_call_equals_the_layer_by_layer_path(
    dtype: torch.dtype,
    arch: str,
    overrides: dict[str, object],
    quantization: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # head_dim 32: one the paged decode kernel takes (the whole-layer call needs it).
    model_dir = make_tiny_model_dir(
        tmp_path / arch, arch, head_dim=32, num_hidden_layers=3, **overrides
    )
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, dtype, "cpu")
    model.gemm.prepack = True
    model.gemm.quantization = quantization  # int8 panels: an update quantizes again
    _skip_unless_panels(model, dtype)
    pack_weights(model)
    runs: list[tuple[int, int]] = []
    original = causal_lm.run_layers

    def counted(
        run: LayerRun, step: DecodeStep, x: torch.Tensor, *args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        runs.append((len(run.calls), int(x.shape[0])))
        return original(run, step, x, *args)

    monkeypatch.setattr(causal_lm, "run_layers", counted)
    prompts = _prompts(config.vocab_size, [5, 9, 2, 1, 12])
    got = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
    assert runs == [(config.num_layers, len(prompts))], "the decode step ran all layers at once"
    # A weight update (unpack, write, repack) and a replaced norm: the calls follow them.
    names = ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    params = dict(model.named_parameters())
    copy_weights(model, [(n, torch.randn(params[n].shape).to(dtype)) for n in names])
    norm = model.model.layers[0].post_attention_layernorm
    norm.weight.data = torch.randn(norm.weight.shape).to(dtype)
    updated = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
    assert len(runs) == 2
    one_call, glued_call = fused_decode.decode_call, fused_decode.glued_call
    monkeypatch.setattr(fused_decode, "decode_call", lambda *args: None)
    monkeypatch.setattr(fused_decode, "glued_call", lambda *args: None)
    model.decode_calls.clear()
    want = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
    assert len(runs) == 2, "the layer-by-layer path made no call"
    assert torch.equal(updated, want), "same kernels in the same order: the same bits"
    # A layer without its one call splits the others into runs around it; glued, or
    # (where it does not qualify at all) its own forward.
    monkeypatch.setattr(
        fused_decode,
        "decode_call",
        lambda layer, i, *args: None if i == 1 else one_call(layer, i, *args),
    )
    for glued in (glued_call, lambda *args: None):
        monkeypatch.setattr(fused_decode, "glued_call", glued)
        model.decode_calls.clear()
        kinds = [type(run).__name__ for _, _, run in model.decode_calls.segments()]
        middle = "GluedRun" if glued is glued_call else "NoneType"
        assert kinds == ["LayerRun", middle, "LayerRun"]
        split = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
        assert torch.equal(split, want)
    assert config.num_layers == 3 and runs[2:] == [(1, len(prompts))] * 4
    assert not torch.equal(updated, got)


def test_a_layer_call_keeps_no_weights_alive_and_follows_a_reload(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "llama", "llama", head_dim=32)
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, torch.bfloat16, "cpu")
    model.gemm.prepack = True
    _skip_unless_panels(model, torch.bfloat16)
    pack_weights(model)
    prompts = _prompts(config.vocab_size, [5, 9, 2])
    before = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    layer = model.model.layers[0]
    segments = model.decode_calls.segments()
    assert [run is not None for _, _, run in segments] == [True], "one call for all layers"
    packed = layer.self_attn.qkv.packed
    assert packed is not None
    panels = weakref.ref(packed.data)
    del packed
    # What sleep(2) does to the weights: the packed forms dropped, the values discarded.
    drop_packed(model)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for p in model.parameters():
        p.data = torch.empty(0, dtype=p.dtype)
    gc.collect()
    assert panels() is None, "a layer call does not keep dropped weights in memory"
    # wakeup: reloaded from disk and packed again, at new addresses or reused ones.
    for name, p in model.named_parameters():
        p.data = torch.empty(shapes[name], dtype=p.dtype)
    load_weights(model, iter_stored(model_dir), strict=True, source=str(model_dir))
    pack_weights(model)
    after = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    assert torch.equal(after, before)


@pytest.mark.parametrize("prepack", [False, True])
def test_the_one_call_decode_applies_exactly_where_the_weights_are_panels(
    prepack: bool, tmp_path: Path
) -> None:
    # The predicate the skips above take: wherever it says panels, every layer is in one
    # call; anywhere else (plain weights, oneDNN's layout) none is, and the step still runs.
    model_dir = make_tiny_model_dir(tmp_path / "llama", "llama", head_dim=32)
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, torch.bfloat16, "cpu")
    model.gemm.prepack = prepack
    pack_weights(model)
    panels = model.gemm.packed_form(torch.bfloat16) in ONE_CALL_FORMS
    bf16 = torch.bfloat16
    assert panels == (
        prepack and (can_pack_pairs(bf16) or (can_pack_panels(bf16) and not can_prepack(bf16)))
    )
    # Elsewhere every layer is glued around its products (``test_glued_layers_...``).
    kinds = [type(run) for _, _, run in model.decode_calls.segments()]
    assert kinds == [LayerRun if panels else fused_decode.GluedRun]
    prompts = _prompts(config.vocab_size, [5, 9, 2])
    got = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    plain = load_model(config, model_dir, torch.bfloat16, "cpu")
    plain.use_kernels = False
    want = _prefill_then_decode(plain, [list(p) for p in prompts], torch.bfloat16)
    torch.testing.assert_close(got, want, **HALF_LOGITS)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 6})],
)
@pytest.mark.parametrize("prepack", [False, True])
def test_glued_layers_equal_the_layer_by_layer_path(
    dtype: torch.dtype,
    arch: str,
    overrides: dict[str, object],
    prepack: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    without_avx512_bf16: None,
) -> None:
    # Weights that are not panels (plain ones; oneDNN's layout on AVX-512 without its BF16
    # kernels, or for fp16): each layer of a decode step makes its 4 products through
    # Gemm.linear and 4 glue calls, no forward.
    model_dir = make_tiny_model_dir(
        tmp_path / arch, arch, head_dim=32, num_hidden_layers=3, **overrides
    )
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, dtype, "cpu")
    model.gemm.prepack = prepack
    if model.gemm.packed_form(dtype) in ("panels", "int8"):
        pytest.skip(f"{dtype} weights pack into panels here ({_isa()}): they run in one call")
    pack_weights(model)  # with the AVX-512 BF16 kernels off (the fixture): no pair panels
    [(start, stop, run)] = model.decode_calls.segments()
    assert (start, stop) == (0, config.num_layers) and isinstance(run, fused_decode.GluedRun)
    stages: list[int] = []
    glue = fused_decode.calls.glue

    def counted(call: object, step: object, stage: int, *args: torch.Tensor) -> None:
        stages.append(stage)
        glue(call, step, stage, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_decode.calls, "glue", counted)
    forwards: list[int] = []
    forward = DecoderLayer.forward

    def counted_forward(self: DecoderLayer, *args: Any) -> Any:
        forwards.append(1)
        return forward(self, *args)

    monkeypatch.setattr(DecoderLayer, "forward", counted_forward)
    prompts = _prompts(config.vocab_size, [5, 9, 2, 1, 12])
    got = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
    assert len(forwards) == config.num_layers, "the prefill's forwards; the decode's glued"
    assert stages == [0, 1, 2, 3] * config.num_layers, "one decode step, 4 stages a layer"
    monkeypatch.setattr(fused_decode, "glued_call", lambda *args: None)
    model.decode_calls.clear()
    assert [run for _, _, run in model.decode_calls.segments()] == [None] * config.num_layers
    want = _prefill_then_decode(model, [list(p) for p in prompts], dtype)
    assert torch.equal(got, want), "same kernels in the same order: the same bits"
    plain = load_model(config, model_dir, dtype, "cpu")
    plain.use_kernels = False
    torch_path = _prefill_then_decode(plain, [list(p) for p in prompts], dtype)
    torch.testing.assert_close(got, torch_path, **HALF_LOGITS)
    assert_same_argmax(got, torch_path, 2 * HALF_LOGITS["atol"])


@pytest.mark.parametrize("prepack", [False, True])
def test_the_decode_calls_follow_an_update_of_the_qkv_biases(
    prepack: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The calls hold the q/k/v biases as one fused copy; an update writes the parameters in
    # place (same address), so copy_weights must make the calls again.
    model_dir = make_tiny_model_dir(tmp_path / "qwen2", "qwen2", head_dim=32)
    config = load_model_config(model_dir)
    model = load_model(config, model_dir, torch.bfloat16, "cpu")
    model.gemm.prepack = prepack
    pack_weights(model)
    assert all(run is not None for _, _, run in model.decode_calls.segments())
    prompts = _prompts(config.vocab_size, [5, 9, 2])
    _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"]
    params = dict(model.named_parameters())
    copy_weights(model, [(n, torch.randn(params[n].shape).to(torch.bfloat16)) for n in names])
    got = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    monkeypatch.setattr(fused_decode, "decode_call", lambda *args: None)
    monkeypatch.setattr(fused_decode, "glued_call", lambda *args: None)
    model.decode_calls.clear()
    want = _prefill_then_decode(model, [list(p) for p in prompts], torch.bfloat16)
    assert torch.equal(got, want), "the calls read the new biases"
