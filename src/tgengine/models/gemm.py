"""``Gemm``: the linear layers' matrix products, routed to the fastest CPU kernel for their size.

- One or two rows in bf16/fp16 (batch-1 decode): ATen's GEMV. oneDNN reorders the weight on
  every call, which dominates a one-row product; the GEMV streams it about twice as fast.
- 3 to ``PACK_MAX_ROWS`` rows, when ``prepack`` is on: oneDNN with the weight reordered once
  and cached (1.3-2.4x faster than ``F.linear`` for 8-64 rows). Opt-in, because the cache is a
  copy of the weights: whoever changes the weights (an update in place, sleep, wakeup) must
  call ``weights_changed()``, or the cache would keep serving the old ones.
- 3 or more rows in bf16/fp16 on a CPU without native half-precision matrix instructions
  (AVX2 and older: oneDNN then refuses to pack, and its bf16 products run 3-8x slower than
  float32): the weight is widened to float32 a slice of rows at a time (``UPCAST_CHUNK``
  elements, a transient buffer, never a second resident copy) and multiplied in float32.
- Everything else (prefill, float32, other devices): ``F.linear``.

All paths compute the same products; only the kernels differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 2
PACK_MAX_ROWS = 128
UPCAST_CHUNK = 4 * 1024 * 1024  # weight elements widened at once: 16 MiB of float32
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


class Gemm:
    """Linear products for one model; ``prepack`` (default off) enables the packed-weight cache."""

    def __init__(self) -> None:
        self.prepack = False
        self._packed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        # A running total, so that other threads read it while a forward packs more.
        self.packed_bytes = 0
        """Host memory the packed copies take (0 unless ``prepack``)."""

    def weights_changed(self) -> None:
        """Forget everything derived from the weights; call after changing or replacing them."""
        self._packed = {}
        self.packed_bytes = 0

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type != "cpu" or x.dtype not in _HALF or not torch.backends.mkldnn.enabled:
            return F.linear(x, weight, bias)
        if rows <= GEMV_MAX_ROWS:
            # A process-wide switch: the one thread that runs forwards holds it for one GEMV.
            torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
            try:
                return F.linear(x, weight, bias)
            finally:
                torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
        if not can_prepack(x.dtype):
            return _upcast_linear(x, weight, bias)
        if self.prepack and rows <= PACK_MAX_ROWS:
            packed = self._packed_weight(weight)
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), tuple(weight.shape))
        packed = self._packed.get(key)
        if packed is None:
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed[key] = packed
            self.packed_bytes += packed.numel() * packed.element_size()
        return packed


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
