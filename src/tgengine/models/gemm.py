"""``Gemm``: the linear layers' matrix products, routed to the fastest CPU kernel for their size.

A linear product's weight is a ``LinearWeights``: one parameter, or several fused as row
blocks of one buffer (q/k/v, gate/up). It is held in exactly one form at a time:

- **packed** (``Gemm.pack``, when ``prepack`` is on): the weight reordered once, and the
  parameters' own storage released (they keep their names, shapes and dtypes, over a
  one-element placeholder). bf16 on a CPU with AVX-512 BF16: into *pair panels*
  (``kernels.pair_panels``: ``vdpbf16ps``, and AMX tiles where the CPU has them; on par with
  oneDNN's packed products from 8 rows up, 1.2-1.7x them below, on Zen 5; with AMX 1.1-2x
  oneDNN's up to 32 rows and 0.65-0.9x it at 128-512 on a Sapphire Rapids class core; and
  they give rows back, so a tied head packs too and the decode runs in one call). From
  ``PAIRS_ONEDNN_MIN_ROWS`` rows (prefill) where the CPU has AMX, a product unpacks its
  weight into a reused buffer (one pass) and runs oneDNN's AMX GEMM, 1.1-1.7x faster there.
  Otherwise, where oneDNN packs this dtype on this CPU (float32 everywhere, bf16/fp16 with
  AVX-512 or AVX-NE-CONVERT), into oneDNN's blocked layout;
  bf16/fp16 elsewhere (AVX2), into tgengine's 16-row ``Panels`` for ``kernels.panel_linear``,
  which widens them in registers (60-80 GFLOP/s on one AVX2 core, 1.2-4x the widening path
  below). Every row count runs on it. ``Gemm.unpack`` gives the plain form back, exactly
  (``to_dense``), before anything writes into the parameters.
- **int8 panels** (``Gemm.quantization == "int8"``, bf16/fp16 on CPU): weight-only
  quantization, each output row of the weight rounded to int8 with its own float32 scale
  (``kernels.quantize_panels``), half the bytes of bf16 panels; the same kernel widens the
  int8 values and scales the sums. ``unpack`` gives the dequantized weight back (not the
  original: an update writes the parameters and quantizes them again).
- **plain**: the parameters themselves. Up to ``HALF_KERNEL_MAX_ROWS`` rows in bf16/fp16
  (decode of a few sequences) run tgengine's own kernel (``kernels.half_linear``: the weight
  widened to float32 in registers, one pass over it for every 4 rows; 2.5-4x ATen's GEMV
  here). Without it, one or two rows use ATen's GEMV (oneDNN reorders the weight on every
  call, which dominates a one-row product). More rows in bf16/fp16 on a CPU without native
  half-precision products (AVX2 and older: oneDNN's products there run 3-8x slower than
  float32) widen the weight to float32 a slice of rows at a time (``UPCAST_CHUNK`` elements:
  a transient buffer, never a second resident copy). Everything else: ``F.linear``.

All paths compute the same products; only the kernels differ.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from tgengine import kernels
from tgengine.kernels import pair_panels
from tgengine.models.fused import fused_rows
from tgengine.models.step_timers import ForwardTimes

GEMV_MAX_ROWS = 2
# Rows from which a product on bf16 pair panels unpacks its weight (one pass, into a buffer
# reused product to product) and runs oneDNN's AMX GEMM, where the CPU has AMX: SmolLM2's
# four products of a layer, 30 layers, two threads, on an Intel Xeon VM (amx): 512 rows
# 78 -> 72 ms, 1,024 145 -> 129, 1,957 292 -> 173 (one thread: 473 -> 311); at 256 rows
# the tiles on the panels themselves are as fast or faster (76 against 82 ms, one thread).
PAIRS_ONEDNN_MIN_ROWS = 512
PAIRS_ONEDNN_MAX_ELEMENTS = 8 << 20  # larger weights (a vocabulary's head) stay on the panels
HALF_KERNEL_MAX_ROWS = 8  # measured: above it, widening a slice and oneDNN's sgemm win
UPCAST_CHUNK = 512 * 1024  # weight elements widened at once: 2 MiB of float32, near the L2
_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def can_prepack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT).

    Probed once per dtype on a tiny weight: the ops exist in every build, but refuse at run
    time where the CPU lacks the instructions.
    """
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    ):
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            packed = ops._reorder_linear_weight(torch.ones(16, 16, dtype=dtype))
            ops._linear_pointwise(torch.ones(4, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def can_pack_pairs(dtype: torch.dtype) -> bool:
    """Whether bf16 weights pack as *pair panels* (``kernels.pair_panels``, ``vdpbf16ps``):
    where the AVX-512 BF16 kernels run (``kernels.avx512_bf16()``; off, they take oneDNN's
    layout, as before them)."""
    return dtype == torch.bfloat16 and kernels.avx512_bf16()


def can_pack_panels(dtype: torch.dtype) -> bool:
    """Whether ``Panels`` (tgengine's packed bf16/fp16 layout and kernel) apply on this CPU."""
    return dtype in _HALF and kernels.has_half_linear()


@dataclass(frozen=True)
class Panels:
    """A bf16/fp16 weight of ``rows`` rows packed by ``kernels.pack_panels``, or (``scales``
    set) quantized to int8 panels by ``kernels.quantize_panels`` from a ``dtype`` weight, or
    (``pair_cols`` set) a bf16 weight of that many columns packed as pair panels
    (``kernels.pair_panels``, AVX-512 BF16)."""

    data: torch.Tensor
    rows: int
    scales: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    pair_cols: int | None = None

    def to_dense(self) -> torch.Tensor:
        """The plain weight: exact for half-precision panels, dequantized for int8 ones."""
        if self.pair_cols is not None:
            return pair_panels.unpack_pair_panels(self.data, self.rows, self.pair_cols)
        if self.scales is None:
            return kernels.unpack_panels(self.data, self.rows)
        rows = torch.arange(self.rows)
        return kernels.dequantize_rows(self.data, self.scales, rows).to(self.dtype)

    def rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, ``[len(ids), k]`` (an embedding lookup)."""
        if self.pair_cols is not None:
            return pair_panels.gather_pair_panel_rows(self.data, self.rows, self.pair_cols, ids)
        if self.scales is None:
            return self.data[ids // kernels.PANEL, :, ids % kernels.PANEL]
        return kernels.dequantize_rows(self.data, self.scales, ids).to(self.dtype)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, *, float_output: bool = False
    ) -> torch.Tensor:
        if self.pair_cols is not None:
            flat = x.reshape(-1, x.shape[-1])
            if (
                not float_output
                and flat.shape[0] >= PAIRS_ONEDNN_MIN_ROWS
                and self.rows * self.pair_cols <= PAIRS_ONEDNN_MAX_ELEMENTS
                and pair_panels.amx()
            ):
                dense = pair_panels.unpack_pair_panels(
                    self.data, self.rows, self.pair_cols, _dense_scratch(self.rows, self.pair_cols)
                )
                return F.linear(flat, dense, bias).view(*x.shape[:-1], self.rows)
            out = pair_panels.pair_panel_linear(
                flat, self.data, self.rows, bias, float_output=float_output
            )
            return out.view(*x.shape[:-1], self.rows)
        return kernels.panel_linear(
            x, self.data, self.rows, bias, float_output=float_output, scales=self.scales
        )


_scratch = threading.local()


def _dense_scratch(rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` bf16 buffer of this thread's, reused from product to product (a
    fresh one each time would fault its pages in again: megabytes a product)."""
    size = rows * cols
    buffer: torch.Tensor | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.bfloat16)
        _scratch.buffer = buffer
    return buffer[:size].view(rows, cols)


def release_scratch() -> None:
    """Let go of this thread's unpacking buffer (up to ``PAIRS_ONEDNN_MAX_ELEMENTS`` bf16
    values, 16 MiB): a sleep hands it back, and the next long prompt makes it again."""
    _scratch.__dict__.pop("buffer", None)


def data_rows(blocks: Sequence[torch.Tensor]) -> int:
    """The rows of ``blocks`` one above the other."""
    return sum(int(b.shape[0]) for b in blocks)


def _nbytes(packed: torch.Tensor | Panels) -> int:
    if isinstance(packed, Panels):
        scales = packed.scales
        extra = 0 if scales is None else scales.numel() * scales.element_size()
        return packed.data.numel() * packed.data.element_size() + extra
    return packed.numel() * packed.element_size()


class LinearWeights:
    """The weight of one linear product: its modules' weights as row blocks, plain or packed.

    ``rows_read``: an embedding lookup reads its rows too (a tied output head), so it may
    only be packed into a layout that gives rows back (``Panels``, not oneDNN's).
    """

    def __init__(self, linears: Sequence[torch.nn.Module], *, rows_read: bool = False) -> None:
        # The modules, not their parameters: loading may replace a module's parameter objects.
        self._linears = tuple(linears)
        self.rows_read = rows_read
        self.packed: torch.Tensor | Panels | None = None

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return tuple(cast(torch.Tensor, module.weight) for module in self._linears)

    def plain(self) -> torch.Tensor:
        """The ``[sum of rows, in_features]`` weight; only while not packed."""
        if self.packed is not None:
            raise RuntimeError("the weight is packed: unpack it before reading it plain")
        return fused_rows(self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device


class Gemm:
    """Linear products for one model; ``prepack`` (default off) lets ``pack`` pack weights,
    ``quantization`` ``"int8"`` packs them as int8 panels instead."""

    def __init__(self) -> None:
        self.prepack = False
        self.quantization: str | None = None
        # A running total, so that other threads read it while the worker packs or unpacks.
        self.packed_bytes = 0
        """Host memory the packed weights take (the plain ones they replaced are freed)."""
        self.generation = 0
        """Counts the packed forms made and forgotten: a new value means some moved."""
        self.timers: ForwardTimes | None = None
        """Where each product's time is added, while a bench profiles (``models.step_timers``)."""

    def linear(
        self,
        x: torch.Tensor,
        weight: LinearWeights | torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        float_output: bool = False,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; ``float_output``: as float32 (its ``.float()``)."""
        timers = self.timers
        if timers is None:
            return self._linear(x, weight, bias, float_output=float_output)
        start = time.perf_counter()
        try:
            return self._linear(x, weight, bias, float_output=float_output)
        finally:
            timers.products_s += time.perf_counter() - start

    def _linear(
        self,
        x: torch.Tensor,
        weight: LinearWeights | torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        float_output: bool = False,
    ) -> torch.Tensor:
        if float_output:
            if isinstance(weight, LinearWeights) and isinstance(weight.packed, Panels):
                return weight.packed.linear(x, bias, float_output=True)
            return self._linear(x, weight, bias).float()
        if isinstance(weight, LinearWeights):
            packed = weight.packed
            if isinstance(packed, Panels):
                return packed.linear(x, bias)
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            weight = weight.plain()
        if x.device.type != "cpu" or x.dtype not in _HALF or not torch.backends.mkldnn.enabled:
            return F.linear(x, weight, bias)
        if (
            x.dim() == 2
            and x.shape[0] <= HALF_KERNEL_MAX_ROWS
            and weight.dtype == x.dtype
            and kernels.has_half_linear()
        ):
            return kernels.half_linear(x, weight, bias)
        if x.shape[0] <= GEMV_MAX_ROWS:
            # A process-wide switch: the one thread that runs forwards holds it for one GEMV.
            torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
            try:
                return F.linear(x, weight, bias)
            finally:
                torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
        if not can_prepack(x.dtype):
            return _upcast_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def packed_form(
        self, dtype: torch.dtype, device: torch.device | str = "cpu", *, rows_read: bool = False
    ) -> str | None:
        """What ``pack`` makes of a ``dtype`` weight on ``device`` here: ``"int8"`` panels,
        half-precision ``"panels"`` (both tgengine's ``Panels``), oneDNN's layout
        (``"onednn"``), bf16 ``"pairs"`` (``Panels`` too; AVX-512 BF16), or None (it stays
        plain). The one-call decode reads ``Panels`` only (``models.fused_decode``), so the
        tests that expect it ask this."""
        if not self.prepack or torch.device(device).type != "cpu":
            return None
        if self.quantization == "int8":
            return "int8" if can_pack_panels(dtype) else None
        if can_pack_pairs(dtype):
            return "pairs"
        if can_prepack(dtype) and not rows_read:
            return "onednn"
        return "panels" if can_pack_panels(dtype) else None

    def can_pack(self, weights: LinearWeights) -> bool:
        return self._form(weights) is not None

    def _form(self, weights: LinearWeights) -> str | None:
        return self.packed_form(weights.dtype, weights.device, rows_read=weights.rows_read)

    def pack(self, weights: LinearWeights) -> None:
        """Replace the plain weight by its packed form (a no-op where packing is off or absent).

        Peak memory: the plain and the packed form of this one weight, for a moment.
        """
        form = self._form(weights)
        if weights.packed is not None or form is None:
            return
        packed: torch.Tensor | Panels
        with torch.inference_mode(False), torch.no_grad():
            if form == "pairs":  # packed from each module's weight where it is: no plain copy
                blocks = [p.detach() for p in weights.params]
                data = pair_panels.pack_pair_panel_blocks(blocks)
                packed = Panels(data, data_rows(blocks), pair_cols=int(blocks[0].shape[1]))
                self.install(weights, packed)
                return
            plain = weights.plain().detach()
            if form == "int8":
                data, scales = kernels.quantize_panels(plain)
                packed = Panels(data, int(plain.shape[0]), scales, plain.dtype)
            elif form == "onednn":
                packed = torch.ops.mkldnn._reorder_linear_weight(plain)
            else:
                packed = Panels(kernels.pack_panels(plain), rows=int(plain.shape[0]))
            del plain
            self.install(weights, packed)

    def install(self, weights: LinearWeights, packed: torch.Tensor | Panels) -> None:
        """``packed`` becomes the weight; the parameters keep placeholders of their shape."""
        for p in weights.params:
            p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        weights.packed = packed
        self.packed_bytes += _nbytes(packed)
        self.generation += 1

    def write_rows(self, weights: LinearWeights, index: int, tensor: torch.Tensor) -> bool:
        """Write ``tensor`` as the value of ``weights.params[index]`` straight into the packed
        form, in place, where that form takes rows (pair panels); False where it does not
        (then unpack, write and pack again). The pointers the one-call decode holds stay
        valid: the form does not move."""
        packed = weights.packed
        if not isinstance(packed, Panels) or packed.pair_cols is None:
            return False
        params = weights.params
        row0 = data_rows(params[:index])
        if tuple(tensor.shape) != tuple(params[index].shape):
            raise ValueError(f"write_rows: {tuple(tensor.shape)} into {tuple(params[index].shape)}")
        pair_panels.write_pair_panel_rows(packed.data, tensor, row0)
        return True

    def unpack(self, weights: LinearWeights) -> None:
        """Give the parameters their plain values back (exact; int8 panels: dequantized) and
        drop the packed form."""
        packed = weights.packed
        if packed is None:
            return
        with torch.inference_mode(False), torch.no_grad():
            plain = packed.to_dense()
            offset = 0
            for p in weights.params:
                rows = int(p.shape[0])
                p.data = plain[offset : offset + rows]
                offset += rows
        self.drop(weights)

    def drop(self, weights: LinearWeights) -> None:
        """Forget the packed form without restoring the parameters (their values are discarded)."""
        if weights.packed is not None:
            self.packed_bytes -= _nbytes(weights.packed)
            weights.packed = None
            self.generation += 1


def _upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` computed in float32, the weight widened a block of output rows at a time."""
    x32 = x.float()
    step = max(1, UPCAST_CHUNK // max(1, weight.shape[1]))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        part = F.linear(x32, weight[rows].float(), None if bias is None else bias[rows].float())
        out[:, rows] = part
    return out
