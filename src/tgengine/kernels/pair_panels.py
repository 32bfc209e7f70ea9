"""Linear products on bf16 weights packed as *pair panels*, for AVX-512 BF16 (``vdpbf16ps``).

``pack_pair_panels`` lays a ``[n, k]`` weight out as ``[ceil(n / 16), ceil(k / 2), 16, 2]``:
16 output rows side by side, each row's weights in pairs of consecutive inputs, which is
what one ``vdpbf16ps`` multiplies a broadcast pair of ``x`` by (``pair_panels.h``).
``pair_panel_linear`` computes ``F.linear`` on it in one of three variants:

- ``avx512_bf16`` (``pair_panels_avx512.cpp``, built with ``-mavx512f -mavx512bf16`` on any
  machine, run only where the CPU has those flags) and ``portable`` (``pair_panels.cpp``,
  plain float math in the same order, everywhere: the same bits) share one blocking: 8 rows
  of ``x`` by 32 outputs, float32 sums, one rounding; threads split the outputs, 64 rows of
  ``x`` a pass over the weight.
- ``amx`` (``pair_panels_amx.cpp``, run where the CPU has AMX tiles for bf16 and Linux grants
  them): a pair panel is what an AMX B tile loads, so tiles of 16 pairs come straight from
  the panels, 32 rows of ``x`` by 2 panels a block. Its float32 sums are added in the tiles'
  order, not ``vdpbf16ps``'s: close to the others, not the same bits. Off with
  ``TGENGINE_AMX=0`` or ``set_amx(False)``.

Called without a variant, it takes AMX where it is on, AVX-512 BF16 otherwise
(``tg_pair_panel_linear_fast``, which the one-call decode calls too), or the portable twin
where neither runs. ``Gemm`` packs bf16 weights this way where the AVX-512
BF16 kernels run (``kernels.avx512_bf16()``), and the one-call decode reads them; with AMX,
``Gemm`` sends products of 512 rows and more to oneDNN on the weight ``unpack_pair_panels``
gives back in one pass (``models.gemm.PAIRS_ONEDNN_MIN_ROWS``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from tgengine import kernels
from tgengine.runtime import huge_pages

PANEL = 16
VARIANTS = ("amx", "avx512_bf16", "portable")
_KERNELS = {
    "amx": "tg_pair_panel_linear_amx",
    "avx512_bf16": "tg_pair_panel_linear_avx512",
    "portable": "tg_pair_panel_linear",
}


def pack_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[n, k]`` weight as ``[ceil(n / 16), ceil(k / 2), 16, 2]`` (zero-padded)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError("pack_pair_panels: a 2-D bfloat16 weight")
    return pack_pair_panel_blocks([weight])


def pack_pair_panel_blocks(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bf16 row blocks ``blocks`` (each ``[n_i, k]``), one above the other, packed as
    ``pack_pair_panels`` packs their concatenation, without making it: each block is written
    into the panels from where it is (``write_pair_panel_rows``)."""
    rows = sum(int(b.shape[0]) for b in blocks)
    cols = int(blocks[0].shape[1])
    panels = empty_pair_panels(rows, cols, blocks[0].device)
    row0 = 0
    for block in blocks:
        write_pair_panel_rows(panels, block, row0)
        row0 += int(block.shape[0])
    return panels


def empty_pair_panels(rows: int, cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pair panels for a ``[rows, cols]`` weight, their padding zero and the rest unset."""
    shape = (-(-rows // PANEL), -(-cols // 2), PANEL, 2)
    panels = huge_pages.empty(shape, torch.bfloat16, device)
    if rows % PANEL:
        panels[-1, :, rows % PANEL :].zero_()
    if cols % 2:
        panels[:, -1, :, 1].zero_()
    return panels


def _in_place_kernels(panels: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, where they can read and write ``panels`` where they lie (a contiguous CPU
    tensor); None: the torch forms run."""
    lib = kernels.load()
    return (
        lib if lib is not None and panels.device.type == "cpu" and panels.is_contiguous() else None
    )


def write_pair_panel_rows(panels: torch.Tensor, rows: torch.Tensor, row0: int) -> bool:
    """Write ``rows`` (``[r, k]``, any float dtype: cast to bf16) as rows ``row0 ..
    row0 + r - 1`` of the weight ``panels`` holds, in place; False when some value was not
    finite (it is written all the same). In one pass where the kernels load."""
    num_panels, pairs, width, _ = panels.shape
    r, k = rows.shape
    if pairs != -(-k // 2) or row0 < 0 or row0 + r > num_panels * width:
        raise ValueError(f"write_pair_panel_rows: {r}x{k} at row {row0} into {tuple(panels.shape)}")
    rows = rows.to(torch.bfloat16)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    lib = _in_place_kernels(panels)
    if lib is None:
        return _write_rows_torch(panels, rows, row0)
    status = lib.tg_pair_panel_write_rows(
        rows.data_ptr(),
        r,
        k,
        rows.stride(0),
        panels.data_ptr(),
        pairs,
        row0,
        torch.get_num_threads(),
    )
    if status == 2:
        raise ValueError(f"tg_pair_panel_write_rows refused {r}x{k} into {tuple(panels.shape)}")
    return status == 0


def _write_rows_torch(panels: torch.Tensor, rows: torch.Tensor, row0: int) -> bool:
    r, k = rows.shape
    full = panels.transpose(1, 2).reshape(panels.shape[0] * PANEL, -1)  # a copy
    full[row0 : row0 + r, :k] = rows
    if k % 2:
        full[row0 : row0 + r, k] = 0
    packed = full.view(panels.shape[0], PANEL, -1, 2).transpose(1, 2)
    panels.copy_(packed)
    return bool(torch.isfinite(rows).all())


def unpack_pair_panels(
    panels: torch.Tensor, rows: int, cols: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``[rows, cols]`` weight ``pack_pair_panels`` packed, exactly; into ``out`` (a
    contiguous bf16 ``[rows, cols]``) when given. In one pass where the kernels load."""
    if rows > panels.shape[0] * PANEL or panels.shape[1] < -(-cols // 2):
        raise ValueError(f"unpack_pair_panels: {rows}x{cols} from {tuple(panels.shape)}")
    if out is not None and (
        out.shape != (rows, cols) or out.dtype != torch.bfloat16 or not out.is_contiguous()
    ):
        raise ValueError(f"unpack_pair_panels: out {tuple(out.shape)} for {rows}x{cols}")
    lib = _in_place_kernels(panels)
    if lib is not None:
        if out is None:
            out = torch.empty(rows, cols, dtype=torch.bfloat16)
        status = lib.tg_pair_panel_read_rows(
            panels.data_ptr(), panels.shape[1], rows, cols, out.data_ptr(), torch.get_num_threads()
        )
        if status != 0:
            raise ValueError(f"tg_pair_panel_read_rows refused {rows}x{cols}")
        return out
    dense = _unpack_torch(panels, rows, cols)
    return dense if out is None else out.copy_(dense)


def gather_pair_panel_rows(
    panels: torch.Tensor, rows: int, cols: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the ``[rows, cols]`` weight in ``panels``: ``[*ids.shape,
    cols]``, exactly (an embedding lookup on a tied head's panels). ``IndexError`` for an id
    outside ``[0, rows)``. In one pass where the kernels load (32 rows from memory: ~0.27 ms
    against torch's indexing ~0.42; 2,000 rows 1.8 against 5.9 ms)."""
    lib = _in_place_kernels(panels)
    if lib is None:
        return _gather_torch(panels, rows, cols, ids)
    flat = ids.reshape(-1).to(torch.long).contiguous()
    out = torch.empty(flat.shape[0], cols, dtype=torch.bfloat16)
    status = lib.tg_pair_panel_gather_rows(
        panels.data_ptr(),
        panels.shape[1],
        rows,
        flat.data_ptr(),
        flat.shape[0],
        cols,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == 1:
        raise IndexError(f"an id of {flat.tolist()} is outside the weight's {rows} rows")
    if status != 0:
        raise ValueError(f"tg_pair_panel_gather_rows refused {cols} of {tuple(panels.shape)}")
    return out.view(*ids.shape, cols)


def _gather_torch(panels: torch.Tensor, rows: int, cols: int, ids: torch.Tensor) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"an id of {ids.tolist()} is outside the weight's {rows} rows")
    pairs = panels[ids // PANEL, :, ids % PANEL, :]  # [*ids.shape, pairs, 2]
    return pairs.reshape(*ids.shape, 2 * panels.shape[1])[..., :cols]


def _unpack_torch(panels: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    num_panels, pairs, width, two = panels.shape
    full = panels.transpose(1, 2).reshape(num_panels * width, pairs * two)
    return full[:rows, :cols].contiguous()


@functools.cache
def pair_panel_variants() -> tuple[str, ...]:
    """The variants that run here, fastest first (``portable`` wherever the library built)."""
    lib = kernels.load()
    if lib is None:
        return ()
    if lib.tg_cpu_has_avx512_bf16() != 1:
        return ("portable",)
    return VARIANTS if lib.tg_cpu_has_amx() == 1 else VARIANTS[1:]


def amx() -> bool:
    """Whether the AMX kernels run: products on pair panels, and the prefill attention of a
    bf16 cache (``prefill_attention_bf16.cpp``). On where the CPU has AMX tiles for bf16 and
    Linux grants them, unless ``TGENGINE_AMX=0`` is in the environment or
    ``set_amx(False)`` was called."""
    lib = kernels.load()
    return lib is not None and lib.tg_use_amx(-1) == 1


def set_amx(on: bool) -> bool:
    """Turn the AMX kernels on (only where they run) or off, process-wide, for comparisons
    and tests; returns whether they run now."""
    lib = kernels.load()
    return lib is not None and lib.tg_use_amx(int(on)) == 1


def pair_panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    rows: int,
    bias: torch.Tensor | None = None,
    *,
    float_output: bool = False,
    variant: str | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``panels = pack_pair_panels(weight)`` of ``rows``
    output rows, for a 2-D bf16 ``x``; ``variant`` one of ``pair_panel_variants()`` (default:
    the fastest here, as the module says). ``float_output``: the float32 sums plus
    bias, unrounded."""
    have = pair_panel_variants()
    kernel = "tg_pair_panel_linear_fast" if "avx512_bf16" in have else _KERNELS["portable"]
    if variant is not None:
        if variant not in have:
            raise RuntimeError(f"pair_panel_linear: {variant!r} does not run here ({have})")
        kernel = _KERNELS[variant]
    if x.dtype != torch.bfloat16 or panels.dtype != torch.bfloat16 or x.dim() != 2:
        raise RuntimeError("pair_panel_linear: bf16 x [m, k] and bf16 pair panels")
    m, k = x.shape
    if panels.dim() != 4 or panels.shape[1] != -(-k // 2) or panels.shape[0] * PANEL < rows:
        raise RuntimeError(f"pair_panel_linear: panels {tuple(panels.shape)} do not fit x {m}x{k}")
    x = x.contiguous()
    panels = panels.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    out = torch.empty(m, rows, dtype=torch.float32 if float_output else torch.bfloat16)
    lib = kernels.load()
    assert lib is not None
    status = getattr(lib, kernel)(
        x.data_ptr(),
        m,
        k,
        panels.data_ptr(),
        rows,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        int(float_output),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"{kernel} refused the shapes (status {status})")
    return out
