"""The compiled kernels give the torch paths' results: paged attention, half-precision linear."""

from __future__ import annotations

import contextlib
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tgengine import kernels
from tgengine.kernels.pair_panels import pair_panel_variants
from tgengine.models.attention import AttentionPlan, KernelDecodePlan, paged_attention, write_kv
from tgengine.models.inputs import ForwardInputs, PrefillSpan

from kernel_helpers import amx, avx512_bf16, require_avx512_bf16

pytestmark = pytest.mark.skipif(
    not kernels.supports(torch.device("cpu"), torch.float32, 64, 1),
    reason="no C++ compiler for tgengine's kernels",
)

# (dtype, tolerance): the kernel sums in float32 like the torch path, rounding differs only
# in the last bit of the output dtype.
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]


def _decode_inputs(lens: list[int], block_size: int, num_blocks: int) -> ForwardInputs:
    width = max(-(-n // block_size) for n in lens)
    ids = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width)
    context = torch.tensor(lens)
    return ForwardInputs(
        input_ids=torch.zeros(len(lens), dtype=torch.long),
        positions=context - 1,
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        decode_rows=torch.arange(len(lens)),
        decode_block_tables=ids,
        decode_context_lens=context,
    )


@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
# Groups of 3, 1, 8 and 6 heads take the kernel's register-blocked passes (4, 4, 1 and 2
# positions a block); 7 heads of 64 its L1-tile passes.
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 32), (16, 2, 128), (12, 2, 80), (14, 2, 64)],
)
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_the_torch_path(
    dtype: torch.dtype,
    tol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
) -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    block_size, num_blocks = 4, 256
    # Lengths of one token, at block boundaries and across many blocks.
    lens = [1, 3, 4, 5, 8, 17, rng.randint(20, 120), rng.randint(20, 120)]
    inputs = _decode_inputs(lens, block_size, num_blocks)
    blocks = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    plain = AttentionPlan.build(inputs, block_size, window)
    fast = AttentionPlan.build(inputs, block_size, window, use_kernel=True)
    assert isinstance(fast.decodes[0], KernelDecodePlan)
    assert not any(isinstance(d, KernelDecodePlan) for d in plain.decodes)
    want = paged_attention(q, q, q, blocks, plain, scale)
    got = paged_attention(q, q, q, blocks, fast, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("avx512", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 32), (16, 2, 128), (8, 1, 256), (24, 3, 96), (12, 2, 80)],
)
@pytest.mark.parametrize("window", [None, 5])
def test_bf16_decode_attention_with_and_without_avx512_bf16_matches_the_torch_path(
    avx512: bool, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None
) -> None:
    # The AVX-512 BF16 form (paged_attention_avx512.cpp: head dims that are multiples of 32;
    # 80 falls back to the AVX2 form) and the AVX2 one, each against the torch path; the two
    # sum in different orders, so each is held to the torch path's tolerance, not to the other.
    torch.manual_seed(head_dim)
    rng = random.Random(head_dim)
    block_size, num_blocks = 16, 256
    lens = [1, 15, 16, 17, 33, rng.randint(40, 300), rng.randint(40, 300)]
    inputs = _decode_inputs(lens, block_size, num_blocks)
    blocks = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).to(torch.bfloat16)
    q = torch.randn(len(lens), num_heads, head_dim).to(torch.bfloat16)
    # Scores of a few units: a softmax that is neither flat nor one-hot.
    scale = 2.0 * head_dim**-0.5
    plain = AttentionPlan.build(inputs, block_size, window)
    fast = AttentionPlan.build(inputs, block_size, window, use_kernel=True)
    want = paged_attention(q, q, q, blocks, plain, scale)
    with avx512_bf16(avx512):
        assert kernels.avx512_bf16() == avx512
        got = paged_attention(q, q, q, blocks, fast, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # Not a copy of the torch path by accident: a wrong scale is caught.
    with avx512_bf16(avx512):
        off = paged_attention(q, q, q, blocks, fast, scale * 1.5)
    assert not torch.allclose(off.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 40])
def test_bf16_decode_attention_gives_the_same_bits_at_any_thread_count(window: int | None) -> None:
    # The AVX-512 BF16 form splits the (sequence, KV head) items into runs of consecutive
    # items of about the same number of positions, a few a thread (so that it can fetch the
    # next item's keys early); contexts of no tokens get zeros. Each item is computed alone:
    # the same bits however the runs fall.
    require_avx512_bf16()
    torch.manual_seed(3)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 16, 512, 9, 3, 64
    lens = [0, 300, 5, 0, 0, 129, 417, 1, 64, 0]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width)
    blocks = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).bfloat16()
    q = torch.randn(len(lens), num_heads, head_dim).bfloat16()
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            with avx512_bf16(True):
                outs.append(
                    kernels.paged_decode(q, blocks, tables, torch.tensor(lens), 0.2, window)
                )
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    assert not outs[0][[0, 3, 4, 9]].any(), "no context: zeros"
    with avx512_bf16(False):
        plain = kernels.paged_decode(q, blocks, tables, torch.tensor(lens), 0.2, window)
    torch.testing.assert_close(outs[0].float(), plain.float(), atol=2e-2, rtol=2e-2)


def _prefill_inputs(
    spans: list[tuple[int, int]], block_size: int, num_blocks: int
) -> ForwardInputs:
    """One step of prefill spans, each ``(queries, context_len)``, then one decode row."""
    ids = torch.randperm(num_blocks).tolist()
    positions, slots, prefills = [], [], []
    for queries, context_len in spans:
        table = [ids.pop() for _ in range(-(-context_len // block_size))]
        start = len(positions)
        for pos in range(context_len - queries, context_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        prefills.append(PrefillSpan(start, len(positions), context_len, torch.tensor(table)))
    decode_table = torch.tensor([ids[:3]])
    positions.append(9)
    slots.append(ids[2] * block_size + 9 % block_size)
    return ForwardInputs(
        input_ids=torch.zeros(len(positions), dtype=torch.long),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        decode_rows=torch.tensor([len(positions) - 1]),
        decode_block_tables=decode_table,
        decode_context_lens=torch.tensor([10]),
        prefills=prefills,
    )


@contextlib.contextmanager
def prefill_form(form: str) -> Iterator[None]:
    """The prefill kernel's form for bf16: float32 FMAs, AVX-512 BF16 dot products or AMX
    tiles (each of the last two skips where the CPU lacks it)."""
    with amx(form == "tiles"), avx512_bf16(form == "dots"):
        yield


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for paged_prefill")
@pytest.mark.parametrize(
    ("dtype", "tol", "form"),  # dot products and tiles: bf16 only
    [(*DTYPES[1], "fma"), (*DTYPES[2], "fma"), (*DTYPES[1], "dots"), (*DTYPES[1], "tiles")],
    ids=["bf16", "fp16", "bf16-avx512", "bf16-amx"],
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 32), (16, 2, 128), (6, 2, 80), (8, 1, 256)],
)
@pytest.mark.parametrize("window", [None, 5, 40])
def test_prefill_kernel_matches_the_torch_path(
    dtype: torch.dtype,
    tol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    form: str,
) -> None:
    with prefill_form(form):
        _check_prefill_kernel(dtype, tol, num_heads, num_kv_heads, head_dim, window)


def _check_prefill_kernel(
    dtype: torch.dtype,
    tol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
) -> torch.Tensor:
    torch.manual_seed(0)
    block_size, num_blocks = 4, 256
    # Fresh prompts (one token, within one key tile, across tiles and work items), spans after
    # a cached prefix (a prefix-cache hit, a later chunk), a one-token chunk.
    spans = [(1, 1), (2, 2), (37, 37), (70, 70), (10, 45), (33, 100), (1, 64)]
    inputs = _prefill_inputs(spans, block_size, num_blocks)
    blocks = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim).to(dtype)
    rows = inputs.num_rows
    # q as a view of wider rows, as the fused projection gives it; k/v written to the cache.
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    write_kv(blocks, inputs.slot_mapping, k, v)
    scale = head_dim**-0.5
    plain = AttentionPlan.build(inputs, block_size, window)
    fast = AttentionPlan.build(inputs, block_size, window, prefill_kernel=True)
    assert all(p.kernel for p in fast.prefills) and not any(p.kernel for p in plain.prefills)
    want = paged_attention(q, k, v, blocks, plain, scale)
    got = paged_attention(q, k, v, blocks, fast, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("form", ["dots", "tiles"])
def test_each_bf16_prefill_form_runs_where_it_is_on(form: str) -> None:
    args = (torch.bfloat16, 2e-2, 9, 3, 64, None)
    with prefill_form(form):
        got = _check_prefill_kernel(*args)
    with prefill_form("fma"):
        fmas = _check_prefill_kernel(*args)
    assert not torch.equal(got, fmas), "bf16 products sum in another order than float32 FMAs"


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for paged_prefill")
def test_prefill_kernel_refuses_what_it_does_not_handle() -> None:
    blocks = torch.zeros(2, 1, 4, 4, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="status 4"):  # more queries than context
        kernels.paged_prefill(q, blocks, table, 2, 1.0, None, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        kernels.paged_prefill(q[:, :, ::2], blocks, table, 8, 1.0, None, q[:, :, ::2])
    assert kernels.supports_prefill(torch.device("cpu"), torch.bfloat16, 64, 3)
    assert not kernels.supports_prefill(torch.device("cpu"), torch.float32, 64, 3)
    assert not kernels.supports_prefill(torch.device("cpu"), torch.bfloat16, 48, 1)


def test_kernel_is_built_once_and_cached() -> None:
    library = kernels.load()
    assert library is not None
    assert library._name in {str(p) for p in kernels.cache_dir().glob("tgengine-kernels-*.so")}
    assert kernels.load() is library


def test_a_compiler_without_amx_builds_the_amx_sources_without_their_flags(
    tmp_path: Path,
) -> None:
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++")
    old = tmp_path / "g++"  # a compiler that refuses -mamx-*, as GCC < 11 does
    refuse = 'for a in "$@"; do case "$a" in -mamx*) exit 1;; esac; done'
    old.write_text(f'#!/bin/sh\n{refuse}\nexec {real} "$@"\n')
    old.chmod(0o755)
    flags = kernels._source_flags(str(old))
    assert not [f for fl in flags.values() for f in fl if f.startswith("-mamx")]
    assert "-mavx512bf16" in flags["pair_panels_amx.cpp"], "only the AMX flags go"
    if "amx" in pair_panel_variants():  # this build had them, so g++ takes them
        assert kernels._source_flags(real) == kernels._SOURCE_FLAGS


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TGENGINE_KERNELS", "0")
    kernels.load.cache_clear()
    kernels.has_half_linear.cache_clear()
    try:
        assert kernels.load() is None
        assert not kernels.has_half_linear()
        assert not kernels.supports(torch.device("cpu"), torch.float32, 64, 1)
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
        kernels.has_half_linear.cache_clear()
    assert kernels.load() is not None


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for half_linear")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (97, 64), (50, 1536), (7, 20)])
def test_half_linear_matches_the_float32_product(dtype: torch.dtype, n: int, k: int) -> None:
    # Widened in registers and summed in float32: the float32 product of the half-precision
    # values, rounded once (the summation order differs, so only the last bit may).
    torch.manual_seed(0)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    for rows in (1, 2, 3, 4, 5, 8):  # every tile height (4, 2, 1) and their tails
        x = torch.randn(rows, k).to(dtype)
        for b in (None, bias):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            got = kernels.half_linear(x, weight, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=0.02, rtol=0.01)


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for half_linear")
def test_gemm_takes_the_half_kernel_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from tgengine.models import gemm as gemm_module

    calls: list[int] = []
    real = kernels.half_linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(kernels, "half_linear", spy)
    weight = torch.randn(48, 64).to(torch.bfloat16)
    gemm = gemm_module.Gemm()
    for rows in (1, gemm_module.HALF_KERNEL_MAX_ROWS, gemm_module.HALF_KERNEL_MAX_ROWS + 1):
        gemm.linear(torch.randn(rows, 64).to(torch.bfloat16), weight)
    gemm.linear(torch.randn(1, 64), weight.float())  # float32: oneDNN's
    assert calls == [1, gemm_module.HALF_KERNEL_MAX_ROWS]


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for panel_linear")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (97, 64), (50, 1536), (7, 20)])
def test_panel_linear_matches_the_float32_product(dtype: torch.dtype, n: int, k: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    panels = kernels.pack_panels(weight)
    assert panels.shape == (-(-n // kernels.PANEL), k, kernels.PANEL)
    assert torch.equal(kernels.unpack_panels(panels, n), weight), "packing is exact"
    for rows in (*range(1, 14), 40):  # every tile height (6 .. 1) and several tiles
        x = torch.randn(rows, k).to(dtype)
        for b in (None, bias):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            got = kernels.panel_linear(x, panels, n, b)
            assert got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=0.02, rtol=0.01)
            wide = kernels.panel_linear(x, panels, n, b, float_output=True)
            assert wide.dtype == torch.float32
            assert torch.equal(wide, got.float()), "the same values, stored as float32"


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2/FMA/F16C for panel_linear")
def test_panel_linear_blocks_of_rows_and_threads_change_no_value() -> None:
    """Few rows split the panels between the threads; many (4 blocks a thread and more) are
    widened and multiplied a block of rows at a time (``block_rows``: 30 rows for k = 1536),
    the blocks shared out. Every row count and thread count gives each row's values exactly
    as 6 rows alone do."""
    torch.manual_seed(0)
    n, k = 97, 1536
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    panels = kernels.pack_panels(weight)
    x = torch.randn(371, k).bfloat16()  # 12 blocks of 30 and a tail of 11
    want = torch.cat(
        [kernels.panel_linear(x[i : i + 6], panels, n, bias) for i in range(0, 371, 6)]
    )
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (0, 2, 7, 30, 31, 119, 120, 371):
                got = kernels.panel_linear(x[:rows], panels, n, bias)
                assert torch.equal(got, want[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.has_half_linear(), reason="no AVX2 for argmax_rows")
def test_argmax_rows_is_torchs_argmax() -> None:
    torch.manual_seed(0)
    for shape in [(24, 49152), (1, 49152), (3, 17), (5, 8), (2, 1)]:
        x = torch.randn(*shape)
        assert torch.equal(kernels.argmax_rows(x), x.argmax(-1)), shape
    x = torch.randn(6, 1003)
    x[0, 100] = x[0, 900] = x[0, 1002] = 1e9  # a tie: the first index
    x[1] = -float("inf")  # nothing but -inf: index 0
    x[2] = 0.0
    x[3, 1002] = 50.0  # the maximum in the tail past the last 8 columns
    x[4, :8] = 50.0
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
    strided = torch.randn(30, 64)[:, :50]
    assert torch.equal(kernels.argmax_rows(strided), strided.argmax(-1))
    for col in (3, 1002):  # a NaN in the vector part or in the tail: torch's path
        y = x.clone()
        y[5, col] = float("nan")
        assert kernels.argmax_rows(y) is None
    assert kernels.argmax_rows(x.T) is None  # columns not contiguous
    assert kernels.argmax_rows(x.double()) is None
