"""Which decoder layers run a decode step as one compiled call, and that call's arguments.

A layer qualifies when everything it does has a kernel: pre-norms only, no per-head q/k
norm, a dense MLP with SiLU or GELU-tanh, its four products packed into panels (bf16/fp16 on
AVX2, or int8), one rank. The step qualifies when every row is a decode row attended by the
paged kernel (``CausalLM.forward`` decides, per step). Consecutive qualifying layers run in
one call (``kernels.decode_layer.run_layers``); anything else takes the layer's forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tgengine.kernels.decode_layer import KINDS, DecodeLayerCall, DecodeStep, LayerRun
from tgengine.kernels.elementwise import ACTIVATIONS
from tgengine.models.attention import KernelDecodePlan
from tgengine.models.decoder_layer import DecoderLayer
from tgengine.models.gemm import Gemm, Panels
from tgengine.models.layers import MLP
from tgengine.models.self_attention import StepContext

Segment = tuple[int, int, LayerRun | None]
"""Layers ``[start, stop)``: one call for all of them, or (None) one layer's own forward."""


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
            calls = [
                decode_call(layer, i, self._windows.index(layer.self_attn.window))
                for i, layer in enumerate(self._layers)
            ]
            self._segments = _segments(calls)
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


def _segments(calls: Sequence[DecodeLayerCall | None]) -> list[Segment]:
    segments: list[Segment] = []
    start = 0
    for qualifies, group in itertools.groupby(calls, key=lambda call: call is not None):
        run = list(group)
        stop = start + len(run)
        if qualifies:
            segments.append((start, stop, LayerRun([c for c in run if c is not None])))
        else:
            segments += [(i, i + 1, None) for i in range(start, stop)]
        start = stop
    return segments


def decode_call(layer: DecoderLayer, index: int, plan: int) -> DecodeLayerCall | None:
    """The layer's call (None where it does not qualify). ``index``: the layer's place in the
    KV cache; ``plan``: which of ``decode_step``'s block tables its window attends with."""
    attn, ffn = layer.self_attn, layer.ffn
    if layer.sandwich or layer.parallel.is_parallel or attn.q_norm is not None:
        return None
    if not isinstance(ffn, MLP) or ffn.act not in ACTIVATIONS:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    packed = [w.packed for w in (attn.qkv, attn.o, ffn.gate_up, ffn.down)]
    panels = [p for p in packed if isinstance(p, Panels)]
    if len(panels) != len(packed):
        return None
    dtype = attn.qkv.dtype
    if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
        return None
    bias = attn.qkv_bias()
    if bias is not None:
        bias = bias.to(dtype)
    return DecodeLayerCall(
        dtype=dtype,
        weights=[p.data for p in panels],
        scales=[p.scales for p in panels],
        qkv_bias=bias,
        norms=[n.weight for n in norms],
        eps=norms[0].eps,
        unit_offset=norms[0].unit_offset,
        act=ffn.act,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        inter=panels[2].rows // 2,  # gate and up rows
        scale=attn.scale,
        window=attn.window,
        layer=index,
        rope=attn.rope_index,
        plan=plan,
    )


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
