"""Paged attention on top of torch SDPA: write a step's KV into the cache, then attend.

Decode rows (one query each) are attended in one batched call over their gathered block
tables; each prefill span is attended on its own with a causal mask offset by its cached
prefix. Keys a query must not see are masked out; the cache is zero-initialised, so masked
slots never carry NaN into the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgengine.models.inputs import ForwardInputs, PrefillSpan

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def write_kv(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, Hkv, D]`` at their slots of ``kv_layer`` ``[2, slots, Hkv, D]``."""
    kv_layer[0].index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    kv_layer[1].index_copy_(0, slot_mapping, v.to(kv_layer.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    inputs: ForwardInputs,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention output ``[T, H, D]`` for every row of the step.

    ``q`` is ``[T, H, D]`` and ``k``/``v`` ``[T, Hkv, D]`` (already rotated and already
    written to the cache); ``blocks`` is this layer's cache viewed as
    ``[2, num_blocks, block_size, Hkv, D]``. Rows in neither a decode nor a prefill set are
    left zero.
    """
    out = torch.zeros_like(q)
    if inputs.decode_rows.numel() > 0:
        rows = inputs.decode_rows
        out[rows] = _decode(
            q[rows],
            blocks,
            inputs.decode_block_tables,
            inputs.decode_context_lens,
            scale,
            sliding_window,
        )
    for span in inputs.prefills:
        out[span.start : span.end] = _prefill(q, k, v, blocks, span, scale, sliding_window)
    return out


def _decode(
    q: torch.Tensor,
    blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    kv = blocks[:, block_tables].flatten(2, 3)  # [2, Bd, max_blocks * block_size, Hkv, D]
    keys = kv[0].transpose(1, 2)
    values = kv[1].transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = key_pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > (context_lens[:, None] - 1 - sliding_window)
    out = _sdpa(q[:, :, None, :], keys, values, mask[:, None, None, :], scale)
    return out[:, :, 0, :]


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    num_queries = span.end - span.start
    context_len = span.context_len
    if context_len == num_queries:
        # Nothing cached before this span: its own k/v are the whole context.
        keys, values = k[span.start : span.end], v[span.start : span.end]
    else:
        kv = blocks[:, span.block_table].flatten(1, 2)[:, :context_len]
        keys, values = kv[0], kv[1]
    query = q[span.start : span.end].transpose(0, 1)[None]  # [1, H, n, D]
    keys = keys.transpose(0, 1)[None]
    values = values.transpose(0, 1)[None]
    if context_len == num_queries and sliding_window is None:
        out = _sdpa(query, keys, values, None, scale, is_causal=True)
    else:
        q_pos = torch.arange(num_queries, device=q.device) + (context_len - num_queries)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (q_pos[:, None] - sliding_window)
        out = _sdpa(query, keys, values, mask[None, None], scale)
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
