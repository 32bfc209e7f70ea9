"""Each decoder layer's element-wise work, one compiled pass each (``elementwise.cpp``).

- ``add_rms_norm``: the residual add and the RMSNorm after it (``layers.RMSNorm``).
- ``rope_store_kv``: the rotary embedding of queries and keys, in place, and the store of
  keys and values into the paged cache (``rope.apply_rotary`` + ``attention.write_kv``).
- ``act_mul``: the MLP's ``act(gate) * up`` (``layers.activation``).

Between them they replace about 25 small torch ops per layer, whose dispatch costs as much
as the weights' traffic at batch 1. Each rounds where the torch ops round, so the results
agree with the torch path to the last bit, but for the order of RMSNorm's sum and the last
bit of ``exp``. bf16 and fp16 on AVX2 CPUs (``applies``); the callers keep the torch path
for everything else.
"""

from __future__ import annotations

import torch

from tgengine import kernels

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels run for tensors like ``x`` (CPU, bf16/fp16, the library built)."""
    return (
        x.device.type == "cpu"
        and x.dtype in kernels.HALF_LINEAR_DTYPES
        and kernels.has_half_linear()
    )


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> torch.Tensor:
    """RMSNorm of ``residual + x`` over the last axis; ``residual`` becomes that sum, in place.

    With ``residual`` None, the norm of ``x``. All contiguous ``[rows, size]`` tensors of one
    dtype (``weight`` ``[size]``), where ``applies``.
    """
    _check(x, weight, *([] if residual is None else [residual]))
    out = torch.empty_like(x)
    size = int(x.shape[-1])
    _run(
        "tg_add_rms_norm",
        kernels._DTYPES[x.dtype],
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        x.numel() // size,
        size,
        eps,
        int(unit_offset),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rope_store_kv(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    blocks: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate the queries and keys of ``qkv`` in place and store keys and values in the cache.

    ``qkv`` is ``[rows, num_heads + 2 * Hkv, D]`` (queries, keys, values), ``cos``/``sin``
    ``[rows, rotary_dim]``, ``blocks`` one layer's ``[2, Hkv, num_blocks, block_size, D]``
    cache and ``slot_mapping`` ``[rows]`` int64 slots; where ``applies``.
    """
    _check(qkv, cos, sin, blocks)
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise RuntimeError("rope_store_kv: slot_mapping must be contiguous int64")
    rows, heads, head_dim = qkv.shape
    num_kv_heads = int(blocks.shape[1])
    if heads != num_heads + 2 * num_kv_heads or blocks.shape[-1] != head_dim:
        raise RuntimeError("rope_store_kv: qkv and the cache disagree on heads")
    _run(
        "tg_rope_store_kv",
        kernels._DTYPES[qkv.dtype],
        qkv.data_ptr(),
        rows,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        int(cos.shape[-1]),
        blocks.data_ptr(),
        int(blocks.shape[2] * blocks.shape[3]),
        slot_mapping.data_ptr(),
        torch.get_num_threads(),
    )


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """``activation(act, gate) * up`` for ``gate_up`` ``[rows, 2 * n]`` = ``[gate | up]``."""
    _check(gate_up)
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _run(
        "tg_act_mul",
        kernels._DTYPES[gate_up.dtype],
        ACTIVATIONS[act],
        gate_up.data_ptr(),
        rows,
        width // 2,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _check(first: torch.Tensor, *others: torch.Tensor) -> None:
    if not applies(first):
        raise RuntimeError("an element-wise kernel called where it does not apply")
    for t in (first, *others):
        if t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
            raise RuntimeError("the element-wise kernels need contiguous tensors of one dtype")


def _run(kernel: str, *args: object) -> None:
    lib = kernels.load()
    assert lib is not None  # applies() said so
    status = getattr(lib, kernel)(*args)
    if status != 0:
        raise RuntimeError(f"{kernel} refused the shapes (status {status})")
