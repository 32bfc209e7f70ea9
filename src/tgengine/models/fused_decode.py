"""Which decoder layers run a decode step in compiled calls, and those calls' arguments.

A layer qualifies when everything it does has a kernel: pre-norms only, no per-head q/k
norm, a dense MLP with SiLU or GELU-tanh, bf16/fp16, one rank. The step qualifies when every
row is a decode row attended by the paged kernel (``CausalLM.forward`` decides, per step).
Where a layer's four products are packed into panels (bf16/fp16 on AVX2, bf16 pair panels
on AVX-512 BF16, or int8), consecutive such layers run in one call
(``kernels.decode_layer.run_layers``). Where they are not (oneDNN's layout: fp16 on AVX-512,
or ``TGENGINE_AVX512_BF16=0``; plain weights), the layer is *glued*: its products run
through ``Gemm.linear`` and everything between them in four compiled calls
(``kernels.decode_layer.glue``), instead of the layer's forward (its Python made a tenth of
a batch-1 step). Both give the layer-by-layer path's bits. Any other layer takes its forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgengine.kernels import decode_layer as calls
from tgengine.kernels.decode_layer import KINDS, DecodeLayerCall, DecodeStep, LayerRun
from tgengine.kernels.elementwise import ACTIVATIONS
from tgengine.models.attention import KernelDecodePlan
from tgengine.models.decoder_layer import DecoderLayer
from tgengine.models.gemm import Gemm, LinearWeights, Panels
from tgengine.models.layers import MLP
from tgengine.models.self_attention import StepContext


@dataclass(frozen=True)
class GluedLayer:
    """A qualifying layer whose products are not panels: its arguments for ``glue`` (no
    panels) and its weights, which ``Gemm.linear`` multiplies by in whatever form they are."""

    call: DecodeLayerCall
    weights: tuple[LinearWeights, LinearWeights, LinearWeights, LinearWeights]  # qkv o gu down
    qkv_bias: torch.Tensor | None
    q_size: int
    inter: int


@dataclass(frozen=True)
class GluedRun:
    layers: tuple[GluedLayer, ...]


Segment = tuple[int, int, LayerRun | GluedRun | None]
"""Layers ``[start, stop)``: one call for all of them, glued layers, or (None) one layer's
own forward."""


class DecodeCalls:
    """The layers of a decode step as segments: each run of consecutive layers that qualify
    in one call (``LayerRun``), every other layer on its own. Made once, and again whenever
    a weight a call reads moved.

    The calls hold pointers, not tensors (``sleep`` must be able to free the weights), so
    ``segments()`` checks, once per step, that nothing they point into moved: the packed
    weights through ``Gemm.generation`` (bumped whenever a packed form is made or forgotten),
    the norms and biases through their addresses. (Checked layer by layer, pointer by
    pointer, the check cost 0.7 ms a step, more than the Python it saves.)
    """

    def __init__(
        self, layers: Sequence[DecoderLayer], windows: Sequence[int | None], gemm: Gemm
    ) -> None:
        self._layers = list(layers)
        self._windows = tuple(windows)
        self._gemm = gemm
        # The parameter dicts of the norms (their weights) and of the q/k/v projections
        # (their biases; the weights are packed): a loader may replace a parameter object, a
        # sleep its storage.
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
        self._norms = [module._parameters for pair in norms for module in pair]
        self._projs = [d for layer in layers for d in layer.self_attn.bias_params]
        self._segments: list[Segment] = []
        self._key: tuple[int | None, ...] | None = None

    def segments(self) -> list[Segment]:
        key = self._where()
        if key != self._key:
            found: list[DecodeLayerCall | GluedLayer | None] = []
            for i, layer in enumerate(self._layers):
                plan = self._windows.index(layer.self_attn.window)
                found.append(decode_call(layer, i, plan) or glued_call(layer, i, plan))
            self._segments = _segments(found)
            self._key = key
        return self._segments

    def clear(self) -> None:
        """Make the calls again at the next step."""
        self._key = None

    def _where(self) -> tuple[int | None, ...]:
        return (
            self._gemm.generation,
            *[d["weight"].data_ptr() for d in self._norms],  # type: ignore[union-attr]
            *[d["bias"].data_ptr() for d in self._projs],  # type: ignore[union-attr]
        )


def _segments(found: Sequence[DecodeLayerCall | GluedLayer | None]) -> list[Segment]:
    segments: list[Segment] = []
    start = 0
    for kind, group in itertools.groupby(found, key=type):
        run = list(group)
        stop = start + len(run)
        if kind is DecodeLayerCall:
            one_call = [c for c in run if isinstance(c, DecodeLayerCall)]
            segments.append((start, stop, LayerRun(one_call)))
        elif kind is GluedLayer:
            segments.append(
                (start, stop, GluedRun(tuple(c for c in run if isinstance(c, GluedLayer))))
            )
        else:
            segments += [(i, i + 1, None) for i in range(start, stop)]
        start = stop
    return segments


def decode_call(layer: DecoderLayer, index: int, plan: int) -> DecodeLayerCall | None:
    """The layer's one call (None where it does not qualify or its weights are not all
    panels). ``index``: the layer's place in the KV cache; ``plan``: which of
    ``decode_step``'s block tables its window attends with."""
    attn, ffn = layer.self_attn, layer.ffn
    if not _qualifies(layer) or not isinstance(ffn, MLP):
        return None
    packed = [w.packed for w in (attn.qkv, attn.o, ffn.gate_up, ffn.down)]
    panels = [p for p in packed if isinstance(p, Panels)]
    if len(panels) != len(packed) or len({p.pair_cols is None for p in panels}) != 1:
        return None
    return _call(layer, index, plan, panels)


def glued_call(layer: DecoderLayer, index: int, plan: int) -> GluedLayer | None:
    """The layer glued around its products (None where it does not qualify); for a layer
    whose weights are not all panels (``decode_call`` takes those)."""
    attn, ffn = layer.self_attn, layer.ffn
    if not _qualifies(layer) or not isinstance(ffn, MLP):
        return None
    call = _call(layer, index, plan, None)
    weights = (attn.qkv, attn.o, ffn.gate_up, ffn.down)
    q_size = attn.num_heads * attn.head_dim
    inter = int(call.args.inter)
    return GluedLayer(call, weights, call.qkv_bias, q_size, inter)


def _qualifies(layer: DecoderLayer) -> bool:
    attn, ffn = layer.self_attn, layer.ffn
    if layer.sandwich or layer.parallel.is_parallel or attn.q_norm is not None:
        return False
    if not isinstance(ffn, MLP) or ffn.act not in ACTIVATIONS:
        return False
    dtype = attn.qkv.dtype
    if dtype not in (torch.bfloat16, torch.float16) or attn.qkv.device.type != "cpu":
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms)


def _call(
    layer: DecoderLayer, index: int, plan: int, panels: Sequence[Panels] | None
) -> DecodeLayerCall:
    attn, ffn = layer.self_attn, layer.ffn
    assert isinstance(ffn, MLP)
    dtype = attn.qkv.dtype
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    bias = attn.qkv_bias()
    if bias is not None:
        bias = bias.to(dtype)
    gate_up_rows = sum(int(p.shape[0]) for p in ffn.gate_up.params)
    return DecodeLayerCall(
        dtype=dtype,
        weights=[None] * 4 if panels is None else [p.data for p in panels],
        scales=[None] * 4 if panels is None else [p.scales for p in panels],
        qkv_bias=bias,
        norms=[n.weight for n in norms],
        eps=norms[0].eps,
        unit_offset=norms[0].unit_offset,
        act=ffn.act,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        inter=gate_up_rows // 2,  # gate and up rows
        scale=attn.scale,
        window=attn.window,
        layer=index,
        rope=attn.rope_index,
        plan=plan,
        pairs=panels is not None and panels[0].pair_cols is not None,
    )


def run_glued(
    run: GluedRun,
    step: DecodeStep,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gemm: Gemm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mlp output, residual stream)`` after the glued layers of ``run``, as their forwards
    one after the other would give (the same kernels in the same order: the same bits).

    ``x`` and ``residual`` as ``kernels.decode_layer.run_layers`` takes them; ``step`` filled
    by ``decode_step``, its ``spent_ns`` (if set) timing the attention.
    """
    rows = int(x.shape[0])
    h = torch.empty_like(x)
    for layer in run.layers:
        call, (qkv_w, o_w, gate_up_w, down_w) = layer.call, layer.weights
        calls.glue(call, step, calls.GLUE_INPUT_NORM, x, residual, h)
        if residual is None:
            residual = x  # the first layer's input is the stream the adds write
        qkv = gemm.linear(h, qkv_w, layer.qkv_bias).contiguous()
        attn = x.new_empty(rows, layer.q_size)
        calls.glue(call, step, calls.GLUE_ATTEND, qkv, None, attn)
        o = gemm.linear(attn, o_w).contiguous()
        calls.glue(call, step, calls.GLUE_POST_NORM, o, residual, h)
        gate_up = gemm.linear(h, gate_up_w).contiguous()
        inner = x.new_empty(rows, layer.inter)
        calls.glue(call, step, calls.GLUE_ACT_MUL, gate_up, None, inner)
        x = gemm.linear(inner, down_w).contiguous()
    assert residual is not None
    return x, residual


def decode_step(
    step: StepContext, windows: Sequence[int | None]
) -> tuple[DecodeStep, list[torch.Tensor]]:
    """The step's arguments for ``run_layers``, ``windows[i]``'s block tables as plan ``i``,
    and the tensors they point into (keep them alive until the calls return)."""
    if len(step.rotary) > KINDS or len(windows) > KINDS:
        raise ValueError(f"a decode step holds at most {KINDS} RoPEs and windows")
    cache = step.kv_cache
    first = cache.layer_heads(0)  # checks the head-major layout every layer shares
    args = DecodeStep(
        threads=torch.get_num_threads(),
        rows=int(step.inputs.input_ids.shape[0]),
        num_blocks=int(first.shape[2]),
        block_size=int(first.shape[3]),
        layer_stride=int(cache.kv.stride(0)),
        cache=first.data_ptr(),
    )
    alive = [step.inputs.slot_mapping.contiguous()]
    args.slot_mapping = alive[0].data_ptr()
    for i, (cos, sin) in enumerate(step.rotary):
        alive += [cos.contiguous(), sin.contiguous()]
        args.cos[i], args.sin[i] = alive[-2].data_ptr(), alive[-1].data_ptr()
        args.rot_dim[i] = int(cos.shape[-1])
    for i, window in enumerate(windows):
        plan = step.plans[window].decodes[0]
        assert isinstance(plan, KernelDecodePlan)  # CausalLM.forward checked
        alive += [plan.tables.contiguous(), plan.lens.contiguous()]
        args.tables[i], args.lens[i] = alive[-2].data_ptr(), alive[-1].data_ptr()
        args.table_width[i] = int(alive[-2].shape[1])
    return args, alive
