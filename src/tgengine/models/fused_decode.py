"""Which decoder layers run a decode step as one compiled call, and that call's arguments.

A layer qualifies when everything it does has a kernel: pre-norms only, no per-head q/k
norm, a dense MLP with SiLU or GELU-tanh, its four products packed into panels (bf16/fp16 on
AVX2, or int8), one rank. The step qualifies when every row is a decode row attended by the
paged kernel (``CausalLM.forward`` decides, per step). Consecutive qualifying layers run in
one call (``kernels.decode_layer.run_layers``); anything else takes the layer's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tgengine.models.attention import KernelDecodePlan
from tgengine.models.fused import fused_rows
from tgengine.models.gemm import LinearWeights, Panels
from tgengine.models.kernels.decode_layer import KINDS, DecodeLayerCall, DecodeStep
from tgengine.models.kernels.elementwise import ACTIVATIONS
from tgengine.models.layers import MLP

if TYPE_CHECKING:
    from tgengine.models.llama import DecoderLayer
    from tgengine.models.self_attention import StepContext


def decode_call(
    layer: DecoderLayer, index: int, plan: int, cached: DecodeLayerCall | None
) -> DecodeLayerCall | None:
    """``cached`` if the layer's weights are still the ones it was made from, else a new call
    (None where the layer does not qualify). ``index``: the layer's place in the KV cache;
    ``plan``: which of ``decode_step``'s block tables its window attends with."""
    if cached is not None and _key(cached.sources) == cached.key:
        return cached
    attn, ffn = layer.self_attn, layer.ffn
    if layer.sandwich or layer.parallel.is_parallel or attn.q_norm is not None:
        return None
    if not isinstance(ffn, MLP) or ffn.act not in ACTIVATIONS:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    sources = (attn.qkv, attn.o, ffn.gate_up, ffn.down, *norms, *attn._projs)
    packed = [w.packed for w in (attn.qkv, attn.o, ffn.gate_up, ffn.down)]
    panels = [p for p in packed if isinstance(p, Panels)]
    if len(panels) != len(packed):
        return None
    dtype = attn.qkv.dtype
    if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
        return None
    bias = None
    if attn._projs[0].bias is not None:
        bias = fused_rows([p.bias for p in attn._projs if p.bias is not None]).to(dtype)
    return DecodeLayerCall(
        key=_key(sources),
        sources=sources,
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


def _key(sources: tuple[object, ...]) -> tuple[int | None, ...]:
    """Where the call's pointers point: each product's panels, the norms' and the biases'
    storage. The call keeps none of them alive (a sleep must free them), so a new tensor
    found at an old address is the memory the pointer reads: the call stays right."""
    key: list[int | None] = []
    for source in sources:
        if isinstance(source, LinearWeights):
            packed = source.packed
            if isinstance(packed, Panels):
                scales = packed.scales
                key += [packed.data.data_ptr(), None if scales is None else scales.data_ptr()]
            else:
                key.append(None)
        else:  # a module: its parameters' dict, without nn.Module's slow attribute lookup
            params = source._parameters  # type: ignore[attr-defined]
            for name in ("weight", "bias"):
                param = params.get(name)
                key.append(None if param is None else param.data_ptr())
    return tuple(key)
