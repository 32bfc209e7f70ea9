"""``kernels.pair_panels``: products on bf16 pair panels, every variant against torch.

The ``avx512_bf16`` variant runs only on a CPU with AVX-512 BF16, the ``amx`` one only where
it has AMX tiles for bf16; elsewhere their tests skip, saying so, and the ``portable`` twin
(the same layout and blocking as ``avx512_bf16``) runs the same checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgengine import kernels
from tgengine.kernels import pair_panels
from tgengine.kernels.isa import isa
from tgengine.kernels.pair_panels import (
    VARIANTS,
    empty_pair_panels,
    gather_pair_panel_rows,
    pack_pair_panel_blocks,
    pack_pair_panels,
    pair_panel_linear,
    pair_panel_variants,
    unpack_pair_panels,
    write_pair_panel_rows,
)

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C++ compiler for the kernels")


_NEEDS = {"amx": "AMX tiles for bf16", "avx512_bf16": "AVX-512 BF16"}


def _variant(name: str) -> str:
    if name not in pair_panel_variants():
        pytest.skip(f"the {name} variant needs a CPU with {_NEEDS[name]} (this one: {isa()})")
    return name


@pytest.mark.parametrize(("n", "k"), [(96, 64), (37, 21), (16, 2), (1, 1), (200, 576)])
def test_packing_is_exact(n: int, k: int) -> None:
    weight = torch.randn(n, k).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    assert panels.shape == (-(-n // 16), -(-k // 2), 16, 2)
    assert torch.equal(unpack_pair_panels(panels, n, k), weight)
    assert panels[0, 0, 0, 0] == weight[0, 0] and (k < 2 or panels[0, 0, 0, 1] == weight[0, 1])


def reference_panels(weight: torch.Tensor) -> torch.Tensor:
    """The layout, by its definition: [panel][pair][row of 16][2], zero-padded."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, k + k % 2, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, 16, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


# full 16 x 16 tiles (the 512-bit transpose where built for it), partial ones, odd columns
SHAPES = [(96, 64), (37, 21), (16, 2), (1, 1), (200, 576), (48, 1536), (33, 70)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_row_blocks_pack_and_write_in_place_as_the_layout_says(n: int, k: int) -> None:
    weight = torch.randn(n, k).to(torch.bfloat16)
    want = reference_panels(weight)
    assert torch.equal(pack_pair_panels(weight), want)
    cut = n // 3
    assert torch.equal(pack_pair_panel_blocks([weight[:cut], weight[cut:]]), want)
    # rows written over other values, from a strided view, at an offset: the rest untouched
    panels = reference_panels(torch.ones(n, k, dtype=torch.bfloat16))
    wide = torch.randn(n, k + 6).to(torch.bfloat16)
    wide[:, 3 : 3 + k] = weight
    assert write_pair_panel_rows(panels, wide[cut:, 3 : 3 + k], cut)
    expect = weight.clone()
    expect[:cut] = 1
    assert torch.equal(panels, reference_panels(expect))
    # the plain-torch form (no kernels) writes the same
    again = reference_panels(torch.ones(n, k, dtype=torch.bfloat16))
    assert pair_panels._write_rows_torch(again, weight[cut:].contiguous(), cut)
    assert torch.equal(again, panels)
    # float32 rows are cast as they are written
    assert write_pair_panel_rows(panels, weight.float(), 0)
    assert torch.equal(panels, want)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_unpacking_reads_the_layout_back_exactly_in_one_pass(n: int, k: int) -> None:
    # The kernel (tg_pair_panel_read_rows: 16 x 16 tiles, partial ones, an odd last column)
    # against the weight itself and the plain-torch form; into a given buffer too.
    weight = torch.randn(n, k).to(torch.bfloat16)
    weight[0, 0] = float("nan")  # bits, not values: a NaN comes back as it went in
    panels = reference_panels(weight)
    got = unpack_pair_panels(panels, n, k)
    assert torch.equal(got.view(torch.int16), weight.view(torch.int16))
    assert torch.equal(
        pair_panels._unpack_torch(panels, n, k).view(torch.int16), got.view(torch.int16)
    )
    out = torch.full((n, k), 7.0, dtype=torch.bfloat16)
    assert unpack_pair_panels(panels, n, k, out) is out
    assert torch.equal(out.view(torch.int16), weight.view(torch.int16))
    # fewer rows than the panels hold: the first ones
    half = unpack_pair_panels(panels, n // 2, k)
    assert torch.equal(half.view(torch.int16), weight[: n // 2].view(torch.int16))
    with pytest.raises(ValueError):
        unpack_pair_panels(panels, panels.shape[0] * 16 + 1, k)  # a row past the panels
    with pytest.raises(ValueError):
        unpack_pair_panels(panels, n, k, torch.empty(n, k + 1, dtype=torch.bfloat16))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gathering_rows_reads_each_one_exactly(n: int, k: int) -> None:
    # An embedding lookup on the panels (tg_pair_panel_gather_rows: a column of a panel per
    # id, an odd last column) against the weight's own rows and the plain-torch form, for
    # ids of any shape, repeated ones, none; an id outside the weight is an IndexError.
    weight = torch.randn(n, k).to(torch.bfloat16)
    weight[-1, -1] = float("nan")  # bits, not values
    panels = reference_panels(weight)
    generator = torch.Generator().manual_seed(n * 1000 + k)
    for shape in [(1,), (7,), (3, 5), (0,), (300,)]:
        ids = torch.randint(0, n, shape, generator=generator)
        ids.view(-1)[:1] = n - 1
        got = gather_pair_panel_rows(panels, n, k, ids)
        assert got.shape == (*shape, k)
        assert torch.equal(got.view(torch.int16), weight[ids].view(torch.int16)), shape
        plain = pair_panels._gather_torch(panels, n, k, ids)
        assert torch.equal(plain.view(torch.int16), got.view(torch.int16)), shape
    for bad in (n, -1):
        for gather in (gather_pair_panel_rows, pair_panels._gather_torch):
            with pytest.raises(IndexError):
                gather(panels, n, k, torch.tensor([0, bad]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("n", "k"), [(32, 64), (17, 5)])
def test_writing_rows_says_when_a_value_is_not_finite(bad: float, n: int, k: int) -> None:
    weight = torch.randn(n, k).to(torch.bfloat16)
    panels = empty_pair_panels(n, k)
    assert write_pair_panel_rows(panels, weight, 0)
    weight[n - 1, k - 1] = bad
    assert not write_pair_panel_rows(panels, weight, 0)
    written = unpack_pair_panels(panels, n, k)
    assert torch.equal(written.view(torch.int16), weight.view(torch.int16))  # all the same
    weight[n - 1, k - 1] = 3e38  # large, finite
    assert write_pair_panel_rows(panels, weight, 0)
    with pytest.raises(ValueError):
        write_pair_panel_rows(panels, weight, panels.shape[0] * 16 - n + 1)  # a row past


def test_the_variants_follow_the_cpu_flags() -> None:
    have = pair_panel_variants()
    assert have[-1] == "portable" and set(have) <= set(VARIANTS)
    assert ("avx512_bf16" in have) == (isa() in ("avx512_bf16", "amx"))
    assert ("amx" in have) == (isa() == "amx")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 96, 64), (3, 37, 21), (4, 32, 576), (7, 1536, 576), (33, 50, 130), (70, 40, 96)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_product_matches_torch(variant: str, m: int, n: int, k: int, with_bias: bool) -> None:
    name = _variant(variant)
    torch.manual_seed(m * n + k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    panels = pack_pair_panels(weight)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    wide = pair_panel_linear(x, panels, n, bias, float_output=True, variant=name)
    assert wide.dtype == torch.float32 and wide.shape == (m, n)
    # Float32 sums of k products: off the exact value by a few float32 ulps of the sum.
    scale = (x.double().abs() @ weight.double().abs().T) + 1
    assert ((wide.double() - exact).abs() <= 1e-6 * scale * k**0.5).all()
    got = pair_panel_linear(x, panels, n, bias, variant=name)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, wide.to(torch.bfloat16)), "rounded once, to nearest even"
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 23])  # 1 and 2 rows take 4 panels a block
def test_threads_do_not_change_the_bits(variant: str, threads: int, m: int) -> None:
    name = _variant(variant)
    torch.manual_seed(threads)
    weight = torch.randn(300, 96).to(torch.bfloat16)
    x = torch.randn(m, 96).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = pair_panel_linear(x, panels, 300, variant=name)
        torch.set_num_threads(threads)
        assert torch.equal(pair_panel_linear(x, panels, 300, variant=name), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("m", "n"), [(1, 1000), (2, 1536), (32, 1536)])
def test_avx512_bf16_agrees_with_its_portable_twin(m: int, n: int) -> None:
    name = _variant("avx512_bf16")
    torch.manual_seed(0)
    weight = torch.randn(n, 576).to(torch.bfloat16)
    x = torch.randn(m, 576).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    fast = pair_panel_linear(x, panels, n, float_output=True, variant=name)
    twin = pair_panel_linear(x, panels, n, float_output=True, variant="portable")
    # The same sums in the same order, so the same bits (vdpbf16ps flushes denormals, which
    # these have none of).
    assert torch.equal(fast, twin)


@pytest.mark.parametrize("variant", ["avx512_bf16", "portable"])
@pytest.mark.parametrize("m", [1, 2])
def test_one_or_two_rows_get_the_bits_they_get_in_a_larger_batch(variant: str, m: int) -> None:
    # One or two rows take blocks of 4 panels, more rows blocks of 2: each output's sum keeps
    # its order either way, so a sequence decoded alone gets the bits it gets in a batch.
    name = _variant(variant)
    torch.manual_seed(m)
    weight = torch.randn(1000, 131).to(torch.bfloat16)  # 62.5 panels: a narrow last block
    x = torch.randn(9, 131).to(torch.bfloat16)
    bias = torch.randn(1000).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    batch = pair_panel_linear(x, panels, 1000, bias, float_output=True, variant=name)
    alone = pair_panel_linear(x[:m], panels, 1000, bias, float_output=True, variant=name)
    assert torch.equal(alone, batch[:m])
    rounded = pair_panel_linear(x[:m], panels, 1000, bias, variant=name)
    assert torch.equal(rounded, batch[:m].to(torch.bfloat16))


def test_a_variant_that_does_not_run_here_is_refused() -> None:
    missing = [v for v in VARIANTS if v not in pair_panel_variants()]
    if not missing:
        pytest.skip(f"this CPU ({isa()}) runs every variant")
    panels = pack_pair_panels(torch.zeros(16, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not run here"):
        pair_panel_linear(torch.zeros(1, 4, dtype=torch.bfloat16), panels, 16, variant=missing[0])


@pytest.mark.parametrize(
    ("m", "n", "k"),
    # rows: one, part of a tile, one tile and part of a second, two, a chunk and more;
    # inputs: whole tile steps, a tail of pairs, an odd tail, fewer than one step
    [(1, 1536, 576), (5, 96, 64), (17, 50, 130), (32, 576, 1536), (300, 80, 61), (40, 33, 7)],
)
def test_amx_agrees_with_avx512_bf16_to_float32_rounding(m: int, n: int, k: int) -> None:
    name = _variant("amx")
    torch.manual_seed(m + n + k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    tiles = pair_panel_linear(x, panels, n, float_output=True, variant=name)
    pairs = pair_panel_linear(x, panels, n, float_output=True, variant="avx512_bf16")
    # The same exact products, summed in another order: float32 rounding apart, no more.
    scale = x.float().abs() @ weight.float().abs().T
    assert ((tiles - pairs).abs() <= 4e-7 * scale * k**0.5 + 1e-30).all()
    assert not torch.equal(tiles, pairs) or k < 32, "the tiles ran, not vdpbf16ps"


def test_the_default_takes_amx_while_it_is_on() -> None:
    name = _variant("amx")
    torch.manual_seed(1)
    weight = torch.randn(96, 576).to(torch.bfloat16)
    panels = pack_pair_panels(weight)
    before = pair_panels.amx()
    try:
        for rows in (1, 32):
            x = torch.randn(rows, 576).to(torch.bfloat16)
            assert pair_panels.set_amx(True)
            tiles = pair_panel_linear(x, panels, 96, float_output=True, variant=name)
            assert torch.equal(pair_panel_linear(x, panels, 96, float_output=True), tiles)
            assert not pair_panels.set_amx(False) and not pair_panels.amx()
            pairs = pair_panel_linear(x, panels, 96, float_output=True, variant="avx512_bf16")
            assert torch.equal(pair_panel_linear(x, panels, 96, float_output=True), pairs)
            assert not torch.equal(tiles, pairs)
    finally:
        pair_panels.set_amx(before)
