"""A whole decoder layer of a decode step in one compiled call (``decode_layer.cpp``).

The layer's Python forward makes some nine kernel calls per step; at batch 1 their dispatch
and allocations cost about a tenth of the step. ``DecodeLayerCall`` prepares, once per
layer and weight version, what the call reads (the packed weights, the norms, the sizes), and
``run`` fills in the step's tensors and makes the one call. Same kernels, same order, same
rounding: the results equal the unfused path's (a test compares them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from tgengine.models import kernels
from tgengine.models.kernels.elementwise import ACTIVATIONS

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "dtype",
                "threads",
                "act",
                "unit_offset",
                "rows",
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "rot_dim",
                "inter",
                "num_blocks",
                "block_size",
                "table_width",
                "window",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[
            (name, _PTR)
            for name in (
                "x",
                "residual",
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
                "cos",
                "sin",
                "cache",
                "slot_mapping",
                "tables",
                "lens",
                "out",
            )
        ],
    ]


class DecodeLayerCall:
    """One layer's fixed arguments: its packed weights (``kernels.pack_panels`` form, or
    ``kernels.quantize_panels``' int8 panels with their scales), norms and sizes. ``key``
    identifies the weights it was made from, ``sources`` where they live; make a new one
    when they change (an update or a wakeup repacks them)."""

    def __init__(
        self,
        *,
        key: Sequence[object],
        sources: Sequence[object],
        dtype: torch.dtype,
        weights: Sequence[torch.Tensor],  # qkv, o, gate_up, down panels
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
    ) -> None:
        self.key = tuple(key)
        self.sources = tuple(sources)
        """What ``key`` was computed from (the caller recomputes it to see a change)."""
        # The weights are not kept alive (``sleep`` must be able to free them: ``key``
        # tells when they move); the bias may be a converted copy, kept.
        self._bias = qkv_bias
        qkv, o, gate_up, down = weights
        qkv_s, o_s, gate_up_s, down_s = (None if s is None else s.data_ptr() for s in scales)
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
            eps=eps,
            scale=scale,
            input_norm=norms[0].data_ptr(),
            post_norm=norms[1].data_ptr(),
            qkv_panels=qkv.data_ptr(),
            qkv_bias=None if qkv_bias is None else qkv_bias.data_ptr(),
            o_panels=o.data_ptr(),
            gate_up_panels=gate_up.data_ptr(),
            down_panels=down.data_ptr(),
            qkv_scales=qkv_s,
            o_scales=o_s,
            gate_up_scales=gate_up_s,
            down_scales=down_s,
        )

    def run(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)`` of the layer, as ``DecoderLayer.forward``.

        ``x`` and ``residual`` ``[rows, hidden]`` contiguous (``residual`` None for the first
        layer: ``x`` is then the stream, and is written in place like ``residual``);
        ``cache`` this layer's ``[2, Hkv, num_blocks, block_size, D]``; ``tables`` ``[rows,
        W]`` and ``lens`` ``[rows]`` int64, contiguous, as ``kernels.paged_decode``.
        """
        args = self.args
        out = torch.empty_like(x)
        args.threads = torch.get_num_threads()
        args.rows = x.shape[0]
        args.rot_dim = cos.shape[-1]
        args.num_blocks = cache.shape[2]
        args.block_size = cache.shape[3]
        args.table_width = tables.shape[1]
        args.x = x.data_ptr()
        args.residual = None if residual is None else residual.data_ptr()
        args.cos = cos.data_ptr()
        args.sin = sin.data_ptr()
        args.cache = cache.data_ptr()
        args.slot_mapping = slot_mapping.data_ptr()
        args.tables = tables.data_ptr()
        args.lens = lens.data_ptr()
        args.out = out.data_ptr()
        lib = kernels.load()
        assert lib is not None
        status = lib.tg_decode_layer(ctypes.byref(args))
        if status != 0:
            raise RuntimeError(f"tg_decode_layer refused the step (status {status})")
        return out, (x if residual is None else residual)
