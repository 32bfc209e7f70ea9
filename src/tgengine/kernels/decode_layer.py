"""Runs of decoder layers of a decode step in one compiled call (``decode_layer.cpp``).

A layer's Python forward makes some nine kernel calls per step; at batch 1 their dispatch
and allocations cost about a tenth of the step, and even one call per layer left a quarter
of a one-sequence step in Python. ``DecodeLayerCall`` prepares, once per layer and weight
version, what a layer's call reads (the packed weights, the norms, the sizes); a
``DecodeStep`` holds what the step gives every layer (its cos/sin, block tables, the cache);
a ``LayerRun`` holds consecutive layers' calls, and ``run_layers`` makes their one call.
Same kernels, same order, same rounding: the results equal the unfused path's (a test
compares them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tgengine import kernels
from tgengine.kernels.elementwise import ACTIVATIONS

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


KINDS = 4  # RoPEs and block-table plans one step may hold (decode_layer.cpp's kKinds)


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "dtype",
                "act",
                "unit_offset",
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "inter",
                "window",
                "layer",
                "rope",
                "plan",
                "pairs",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[
            (name, _PTR)
            for name in (
                "input_norm",
                "post_norm",
                "qkv_panels",
                "qkv_bias",
                "o_panels",
                "gate_up_panels",
                "down_panels",
                "qkv_scales",
                "o_scales",
                "gate_up_scales",
                "down_scales",
            )
        ],
    ]


class DecodeStep(ctypes.Structure):
    """The step's arguments every layer call reads (``decode_layer.cpp``'s ``DecodeStep``)."""

    _fields_ = [
        *[(name, _I64) for name in ("threads", "rows", "num_blocks", "block_size", "layer_stride")],
        ("cache", _PTR),
        ("slot_mapping", _PTR),
        ("cos", _PTR * KINDS),
        ("sin", _PTR * KINDS),
        ("tables", _PTR * KINDS),
        ("lens", _PTR * KINDS),
        ("rot_dim", _I64 * KINDS),
        ("table_width", _I64 * KINDS),
        ("spent_ns", _PTR),  # null, or an int64[2]: ns in products, in attention (profiling)
    ]


class DecodeLayerCall:
    """One layer's fixed arguments: its packed weights (``kernels.pack_panels`` form,
    ``kernels.quantize_panels``' int8 panels with their scales, or, ``pairs``, bf16 pair
    panels: ``kernels.pair_panels``, AVX-512 BF16 only; None for a layer whose
    products run outside, ``glue``), norms and sizes, as pointers; make a new one when they
    move (an update or a wakeup repacks them: ``fused_decode.DecodeCalls``)."""

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        weights: Sequence[torch.Tensor | None],  # qkv, o, gate_up, down panels
        scales: Sequence[torch.Tensor | None],  # their row scales where they are int8
        qkv_bias: torch.Tensor | None,
        norms: Sequence[torch.Tensor],  # input, post-attention
        eps: float,
        unit_offset: bool,
        act: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        inter: int,
        scale: float,
        window: int | None,
        layer: int,
        rope: int,
        plan: int,
        pairs: bool = False,
    ) -> None:
        # The weights are not kept alive (``sleep`` must be able to free them); the bias may
        # be a converted copy, kept.
        self.qkv_bias = qkv_bias
        qkv_s, o_s, gate_up_s, down_s = (None if s is None else s.data_ptr() for s in scales)
        qkv, o, gate_up, down = (None if w is None else w.data_ptr() for w in weights)
        self.args = _DecodeLayer(
            dtype=kernels._DTYPES[dtype],
            act=ACTIVATIONS[act],
            unit_offset=int(unit_offset),
            hidden=int(norms[0].shape[0]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            inter=inter,
            window=window or 0,
            layer=layer,
            rope=rope,
            plan=plan,
            pairs=int(pairs),
            eps=eps,
            scale=scale,
            input_norm=norms[0].data_ptr(),
            post_norm=norms[1].data_ptr(),
            qkv_panels=qkv,
            qkv_bias=None if qkv_bias is None else qkv_bias.data_ptr(),
            o_panels=o,
            gate_up_panels=gate_up,
            down_panels=down,
            qkv_scales=qkv_s,
            o_scales=o_s,
            gate_up_scales=gate_up_s,
            down_scales=down_s,
        )


class LayerRun:
    """Consecutive layers' calls, and the array of their arguments ``tg_decode_layers`` reads
    (made with the calls, not every step)."""

    def __init__(self, calls: Sequence[DecodeLayerCall]) -> None:
        self.calls = tuple(calls)
        self.args = (ctypes.POINTER(_DecodeLayer) * len(calls))(
            *[ctypes.pointer(c.args) for c in calls]
        )


def run_layers(
    run: LayerRun,
    step: DecodeStep,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    spent_ns: ctypes.Array[ctypes.c_int64] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mlp output, residual stream)`` after the consecutive layers of ``run``, as their
    ``DecoderLayer.forward`` one after the other would give.

    ``x`` and ``residual`` ``[rows, hidden]`` contiguous (``residual`` None before the first
    layer: ``x`` is then the stream, and is written in place like ``residual``); ``step``
    filled by ``fused_decode.decode_step`` for this forward, its tensors still alive.
    ``spent_ns``: an ``int64[2]`` the call adds its nanoseconds in products and in attention
    to (``models.step_timers``; None: nothing is timed).
    """
    out = torch.empty_like(x)
    lib = kernels.load()
    assert lib is not None
    step.spent_ns = None if spent_ns is None else ctypes.cast(spent_ns, _PTR).value
    status = lib.tg_decode_layers(
        run.args,
        len(run.calls),
        ctypes.byref(step),
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"tg_decode_layers refused the step (status {status})")
    return out, (x if residual is None else residual)


GLUE_INPUT_NORM, GLUE_ATTEND, GLUE_POST_NORM, GLUE_ACT_MUL = range(4)
"""``glue``'s stages (``decode_layer.cpp``'s ``tg_decode_glue``)."""


def glue(
    call: DecodeLayerCall,
    step: DecodeStep,
    stage: int,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """One stage of a layer's work between its products, for a layer whose products run
    outside (``fused_decode.run_glued``): the input norm (``out = norm(residual += x)``;
    ``residual`` None: ``norm(x)``), rotary + KV store + attention of ``x`` = q/k/v, the
    post-attention norm, or ``act(gate) * up``. Tensors contiguous, ``step`` filled by
    ``fused_decode.decode_step`` for this forward."""
    lib = kernels.load()
    assert lib is not None
    status = lib.tg_decode_glue(
        ctypes.byref(call.args),
        ctypes.byref(step),
        stage,
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"tg_decode_glue refused stage {stage} (status {status})")
