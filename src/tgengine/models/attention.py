"""Paged attention on top of torch matmul and SDPA: write a step's KV into the cache, then attend.

``AttentionPlan.build`` turns a step's ``ForwardInputs`` into the index tensors and masks every
layer shares, once per forward. Per layer, decode rows (one query each) are attended in one
batched computation: a single ``index_select`` over the head-major cache gathers the keys and
values of every decode sequence's blocks, already laid out ``[Hkv, Bd, L, D]``, and two batched
matmuls with an additive mask do the rest (the query heads that share a KV head are the rows
of one matmul, so keys and values are never repeated). Each prefill span is attended on its
own: a fresh prompt with causal SDPA on its own keys and values, a span with a cached prefix
over its gathered blocks with an explicit mask; or, on a CPU with a bf16/fp16 cache, any span
with ``kernels.paged_prefill``, straight on the paged cache. Keys a query must not see are
masked out; the cache is zero-initialised, so masked slots never carry NaN into the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgengine import kernels
from tgengine.models.inputs import ForwardInputs, PrefillSpan

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


# Splitting the decode rows into groups of similar length pads fewer blocks (each group is
# padded to its own longest sequence), at the price of one more gather and two more matmuls
# per layer. A split must save at least this many padded blocks (~1 us each per layer on a
# CPU) to pay for those calls; at most this many groups.
_GROUP_COST_BLOCKS = 64
_MAX_GROUPS = 4


@dataclass
class DecodePlan:
    """``num_seqs`` decode rows of a step whose block tables are padded to ``width`` blocks."""

    rows: torch.Tensor  # [Bd] rows of the step
    flat_blocks: torch.Tensor  # [Bd * width] block ids, padded with block 0
    bias: torch.Tensor  # [Bd, 1, width * block_size] float32: 0 where visible, -inf not
    num_seqs: int
    width: int


@dataclass
class KernelDecodePlan:
    """Decode rows attended by the compiled kernel, straight on the paged cache."""

    rows: torch.Tensor  # [Bd] rows of the step
    tables: torch.Tensor  # [Bd, W] block ids
    lens: torch.Tensor  # [Bd] context lengths
    window: int | None
    num_seqs: int


@dataclass
class PrefillPlan:
    span: PrefillSpan
    mask: torch.Tensor | None  # [n, context_len] bool; None: causal over the span's own k/v
    window: int | None = None
    kernel: bool = False  # attended by kernels.paged_prefill (then mask is None)


@dataclass
class AttentionPlan:
    """What every layer's attention needs from one step, computed once per forward."""

    num_rows: int
    decodes: list[DecodePlan | KernelDecodePlan]  # torch: groups of similar context length
    prefills: list[PrefillPlan]
    decode_only: bool  # one decode group holds every row, in order: no scatter needed

    @staticmethod
    def build(
        inputs: ForwardInputs,
        block_size: int,
        sliding_window: int | None,
        *,
        use_kernel: bool = False,
        prefill_kernel: bool = False,
    ) -> AttentionPlan:
        """The plan of one step; ``use_kernel``: decode rows go to ``kernels.paged_decode``,
        ``prefill_kernel``: prefill spans to ``kernels.paged_prefill``."""
        num_rows = inputs.num_rows
        num_decode = int(inputs.decode_rows.shape[0])
        decodes: list[DecodePlan | KernelDecodePlan] = []
        if num_decode and use_kernel:
            tables, lens = inputs.decode_block_tables, inputs.decode_context_lens
            decodes = [
                KernelDecodePlan(inputs.decode_rows, tables, lens, sliding_window, num_decode)
            ]
        elif num_decode:
            decodes = list(_decode_plans(inputs, block_size, sliding_window))
        if prefill_kernel:
            prefills = [PrefillPlan(s, None, sliding_window, kernel=True) for s in inputs.prefills]
        else:
            prefills = [_prefill_plan(span, sliding_window) for span in inputs.prefills]
        decode_only = num_decode == num_rows and len(decodes) == 1 and not prefills
        return AttentionPlan(num_rows, decodes, prefills, decode_only)


def _decode_plans(
    inputs: ForwardInputs, block_size: int, sliding_window: int | None
) -> list[DecodePlan]:
    tables = inputs.decode_block_tables
    lens = inputs.decode_context_lens
    if lens.device.type != "cpu" or lens.shape[0] < 2:
        # On an accelerator, reading the lengths back would stall it; one padded group.
        return [_decode_group(inputs.decode_rows, tables, lens, block_size, sliding_window)]
    widths = [-(-n // block_size) for n in lens.tolist()]
    order = sorted(range(len(widths)), key=widths.__getitem__)
    groups = _split_by_width([widths[i] for i in order])
    if len(groups) == 1:
        return [_decode_group(inputs.decode_rows, tables, lens, block_size, sliding_window)]
    plans = []
    for lo, hi in groups:
        index = torch.tensor(order[lo:hi], dtype=torch.long, device=lens.device)
        width = widths[order[hi - 1]]
        plans.append(
            _decode_group(
                inputs.decode_rows[index],
                tables[index, :width],
                lens[index],
                block_size,
                sliding_window,
            )
        )
    return plans


def _split_by_width(widths: list[int]) -> list[tuple[int, int]]:
    """Cut ascending ``widths`` into ranges, greedily, while a cut saves enough padding."""
    groups = [(0, len(widths))]
    while len(groups) < _MAX_GROUPS:
        best_gain, best = _GROUP_COST_BLOCKS, None
        for g, (lo, hi) in enumerate(groups):
            area = (hi - lo) * widths[hi - 1]
            for cut in range(lo + 1, hi):
                gain = area - (cut - lo) * widths[cut - 1] - (hi - cut) * widths[hi - 1]
                if gain > best_gain:
                    best_gain, best = gain, (g, cut)
        if best is None:
            break
        g, cut = best
        lo, hi = groups[g]
        groups[g : g + 1] = [(lo, cut), (cut, hi)]
    return groups


def _decode_group(
    rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> DecodePlan:
    num_seqs, width = int(tables.shape[0]), int(tables.shape[1])
    key_pos = torch.arange(width * block_size, device=lens.device)
    hidden = key_pos[None, :] >= lens[:, None]
    if sliding_window is not None:
        hidden |= key_pos[None, :] <= (lens[:, None] - 1 - sliding_window)
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=lens.device)
    bias.masked_fill_(hidden, float("-inf"))
    return DecodePlan(
        rows=rows,
        flat_blocks=tables.reshape(-1),
        bias=bias[:, None, :],
        num_seqs=num_seqs,
        width=width,
    )


def _prefill_plan(span: PrefillSpan, sliding_window: int | None) -> PrefillPlan:
    num_queries = span.end - span.start
    context_len = span.context_len
    if context_len == num_queries and sliding_window is None:
        return PrefillPlan(span, None)
    device = span.block_table.device
    q_pos = torch.arange(num_queries, device=device) + (context_len - num_queries)
    key_pos = torch.arange(context_len, device=device)
    mask = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
    return PrefillPlan(span, mask)


def write_kv(
    heads: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at their slots of ``heads`` ``[2, Hkv, nb, bs, D]``."""
    flat = heads.view(2 * heads.shape[1], -1, heads.shape[-1])  # [2 * Hkv, slots, D]
    new = torch.stack((k, v)).to(heads.dtype).transpose(1, 2)  # [2, Hkv, T, D]
    flat.index_copy_(1, slot_mapping, new.reshape(flat.shape[0], -1, flat.shape[-1]))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, H, D]`` for every row of the step.

    ``q`` is ``[T, H, D]`` and ``k``/``v`` ``[T, Hkv, D]`` (already rotated and already
    written to the cache); ``blocks`` is this layer's head-major cache
    ``[2, Hkv, num_blocks, block_size, D]`` (``KVCache.layer_heads``). Rows in neither a
    decode nor a prefill set are left zero.
    """
    if plan.decode_only:
        return _decode(q, blocks, plan.decodes[0], scale)
    covered = sum(d.num_seqs for d in plan.decodes) + sum(
        p.span.end - p.span.start for p in plan.prefills
    )
    out = torch.empty_like(q) if covered == plan.num_rows else torch.zeros_like(q)
    for decode in plan.decodes:
        found = _decode(q.index_select(0, decode.rows), blocks, decode, scale)
        out.index_copy_(0, decode.rows, found)
    for prefill in plan.prefills:
        span = prefill.span
        if prefill.kernel:
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            rows = slice(span.start, span.end)
            kernels.paged_prefill(
                q[rows],
                blocks,
                span.block_table,
                span.context_len,
                scale,
                prefill.window,
                out[rows],
            )
            continue
        out[span.start : span.end] = _prefill(q, k, v, blocks, prefill, scale)
    return out


def _decode(
    q: torch.Tensor, blocks: torch.Tensor, plan: DecodePlan | KernelDecodePlan, scale: float
) -> torch.Tensor:
    if isinstance(plan, KernelDecodePlan):
        return kernels.paged_decode(q, blocks, plan.tables, plan.lens, scale, plan.window)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = blocks.shape[1]
    # One gather for keys and values: [2, Hkv, Bd * width, bs, D] -> [2, Hkv, Bd, L, D].
    kv = blocks.index_select(2, plan.flat_blocks).view(2, num_kv_heads, num_seqs, -1, head_dim)
    # The query heads that share a KV head are that head's rows: [Hkv, Bd, G, D].
    query = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(query, kv[0].transpose(-1, -2)).float()  # [Hkv, Bd, G, L]
    probs = torch.softmax(scores * scale + plan.bias, dim=-1).to(q.dtype)
    out = torch.matmul(probs, kv[1])  # [Hkv, Bd, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
) -> torch.Tensor:
    span = plan.span
    if plan.mask is None or span.context_len == span.end - span.start:
        # Nothing cached before this span: its own k/v are the whole context.
        keys = k[span.start : span.end].transpose(0, 1)[None]  # [1, Hkv, n, D]
        values = v[span.start : span.end].transpose(0, 1)[None]
    else:
        kv = blocks.index_select(2, span.block_table).flatten(2, 3)[:, :, : span.context_len]
        keys, values = kv[0][None], kv[1][None]  # [1, Hkv, context_len, D]
    query = q[span.start : span.end].transpose(0, 1)[None]  # [1, H, n, D]
    if plan.mask is None:
        out = _sdpa(query, keys, values, None, scale, is_causal=True)
    else:
        out = _sdpa(query, keys, values, plan.mask[None, None], scale)
    return out[0].transpose(0, 1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA on ``[B, H, n, D]`` queries and ``[B, Hkv, L, D]`` keys/values (GQA)."""
    if q.shape[1] != k.shape[1] and not _HAS_GQA:
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
