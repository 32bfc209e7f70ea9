"""CPU kernels tgengine compiles itself, once per machine, with a plain-torch fallback.

``paged_decode`` runs decode attention straight on the paged KV cache (see
``paged_attention.cpp``), ``paged_prefill`` a prompt span's attention (``prefill_attention.cpp``;
a bf16 cache's in bf16 products where the CPU has AMX tiles or AVX-512 BF16:
``prefill_attention_bf16.cpp``);
``half_linear`` and ``panel_linear`` run linear products on
bf16/fp16 weights, widening them in registers (see ``half_linear.cpp``; AVX2 + FMA + F16C),
the latter on a weight packed once into 16-row panels (``pack_panels``, or ``quantize_panels``:
int8 with a float32 scale per output row, weight-only quantization); ``elementwise``
fuses each layer's element-wise work (``elementwise*.cpp``); ``argmax_rows`` is greedy
decoding's argmax (``argmax.cpp``); ``decode_layer`` runs a whole
layer of a decode step in one call (``decode_layer.cpp``); ``pair_panels`` runs products on
bf16 weights packed for AVX-512 BF16 (``pair_panels*.cpp``: AMX tiles and AVX-512 BF16
where the CPU has them, a portable twin of the same layout and blocking everywhere). The library is
built on first use with the system's C++ compiler (``g++ -O3 -march=native -fopenmp``, a few
seconds of CPU) into ``$TGENGINE_CACHE`` (default ``~/.cache/tgengine``) ``/kernels/``, keyed
by the sources, the compiler and the CPU's flags, so a warm start only loads it. Without a
compiler, or with ``TGENGINE_KERNELS=0`` in the environment, ``load()`` returns None and the
callers take their torch paths (same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from tgengine.kernels.isa import cpu_flags

log = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "prefill_attention_bf16.cpp",
        "half_linear.cpp",
        "elementwise.cpp",
        "elementwise_avx512.cpp",
        "decode_layer.cpp",
        "argmax.cpp",
        "pair_panels.cpp",
        "pair_panels_avx512.cpp",
        "pair_panels_amx.cpp",
        "pair_panel_rows.cpp",
        "paged_attention_avx512.cpp",
    )
)
_HEADERS = tuple(
    Path(__file__).with_name(n)
    for n in ("simd.h", "simd512.h", "amx.h", "pair_panels.h", "paged_decode_items.h")
)
# Flags of some sources beyond _FLAGS. The AVX-512 ones are built for an ISA beyond the
# machine's own (-march=native): their code runs only where the CPU has it (each says how it
# is guarded), so one build serves every variant. The portable pair-panel twin keeps its sums
# in the order it writes them (the order vdpbf16ps adds in), which -fassociative-math would not.
_AVX512_BF16_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
_AMX_FLAGS = [*_AVX512_BF16_FLAGS, "-mamx-tile", "-mamx-bf16"]
_SOURCE_FLAGS = {
    "pair_panels.cpp": ["-fno-associative-math"],
    "pair_panels_avx512.cpp": _AVX512_BF16_FLAGS,
    "pair_panels_amx.cpp": _AMX_FLAGS,
    "prefill_attention_bf16.cpp": _AMX_FLAGS,
    "paged_attention_avx512.cpp": _AVX512_BF16_FLAGS,
    "elementwise_avx512.cpp": [*_AVX512_BF16_FLAGS, "-mfma", "-mf16c"],  # simd.h's AVX2 tails
}
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",  # lets the compiler vectorise the sums of the dot products
    "-fopenmp",
    "-shared",
    "-fPIC",
]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get("TGENGINE_KERNELS", "1") != "0"


def cache_dir() -> Path:
    from tgengine.runtime.disk_cache import cache_root

    return cache_root() / "kernels"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them first if needed; None when they cannot be had."""
    if not enabled() or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: decode attention uses the torch path")
        return None
    try:
        library = _build(compiler)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("cannot build tgengine's CPU kernels (%s): using the torch paths", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


_INT, _F32 = ctypes.c_int, ctypes.c_float
_PAIR_LINEAR = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT, _INT]
_HALF_LINEAR = [_INT, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT]
_SIGNATURES: dict[str, Sequence[type]] = {  # every function returns an int status or answer
    "tg_paged_decode": [_INT, _PTR, _PTR, _PTR, _PTR, _PTR, *[_I64] * 8, _F32, _INT],
    "tg_paged_prefill": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, *[_I64] * 9, _F32, _INT],
    "tg_half_linear": _HALF_LINEAR,
    "tg_panel_linear": _HALF_LINEAR,
    "tg_panel_linear_f32": _HALF_LINEAR,
    "tg_panel_linear_q8": [_INT, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT, _INT],
    "tg_half_linear_available": [],
    "tg_add_rms_norm": [_INT, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT, _PTR, _INT],
    "tg_rope_store_kv": [_INT, _PTR, *[_I64] * 4, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _INT],
    "tg_act_mul": [_INT, _INT, _PTR, _I64, _I64, _PTR, _INT],
    "tg_argmax_rows": [_PTR, _I64, _I64, _I64, _PTR, _INT],
    "tg_decode_layers": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR],  # decode_layer.py's structures
    "tg_pair_panel_linear": _PAIR_LINEAR,
    "tg_pair_panel_linear_avx512": _PAIR_LINEAR,
    "tg_pair_panel_linear_amx": _PAIR_LINEAR,
    "tg_pair_panel_linear_fast": _PAIR_LINEAR,
    "tg_pair_panel_write_rows": [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _INT],
    "tg_pair_panel_read_rows": [_PTR, _I64, _I64, _I64, _PTR, _INT],
    "tg_pair_panel_gather_rows": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _INT],
    "tg_cpu_has_avx512_bf16": [],
    "tg_cpu_has_amx": [],
    "tg_use_avx512_bf16": [_INT],
    "tg_use_amx": [_INT],
    "tg_paged_decode_bf16_avx512": [_PTR, _PTR, _PTR, _PTR, _PTR, *[_I64] * 8, _F32, _INT],
    "tg_decode_glue": [_PTR, _PTR, _INT, _PTR, _PTR, _PTR],
}


def _source_flags(compiler: str) -> dict[str, list[str]]:
    """``_SOURCE_FLAGS`` without the AMX flags where the compiler lacks them (GCC < 11): those
    sources then build their stubs, and ``tg_cpu_has_amx`` answers 0."""
    probe = [compiler, *_AMX_FLAGS, "-x", "c++", "-c", "-o", os.devnull, "-"]
    if subprocess.run(probe, input=b"", capture_output=True, timeout=60).returncode == 0:
        return _SOURCE_FLAGS
    return {n: [f for f in fl if not f.startswith("-mamx")] for n, fl in _SOURCE_FLAGS.items()}


def _build(compiler: str) -> Path:
    key = hashlib.sha256()
    for source in (*_SOURCES, *_HEADERS):
        key.update(source.read_bytes())
    key.update(" ".join([compiler, *_FLAGS]).encode())
    key.update(repr(sorted(_SOURCE_FLAGS.items())).encode())
    key.update(" ".join(sorted(cpu_flags())).encode() or platform.processor().encode())
    library = cache_dir() / f"tgengine-kernels-{key.hexdigest()[:16]}.so"
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling tgengine's CPU kernels once into %s", library.parent)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        # One compiler per source, side by side (the cores are free at start-up), then a link.
        objects = [Path(tmp) / f"{source.stem}.o" for source in _SOURCES]
        source_flags = _source_flags(compiler)  # probed only here: a warm start just loads
        commands = [
            [compiler, *_FLAGS, *source_flags.get(src.name, []), "-c", "-o", str(obj), str(src)]
            for src, obj in zip(_SOURCES, objects, strict=True)
        ]
        compiles = [
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for cmd in commands
        ]
        try:
            errors = [proc.communicate(timeout=300)[1] for proc in compiles]
        finally:
            for proc in compiles:  # a timeout or an interrupt leaves no compiler behind
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc, err in zip(compiles, errors, strict=True):
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), *map(str, objects)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        os.replace(built, library)  # atomic: a concurrent build never leaves half a file
    return library


_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
_MAX_GROUPS = 8  # query heads per KV head the kernel holds in registers


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int) -> bool:
    """Whether ``paged_decode`` runs for this device, dtype and head layout (builds it once)."""
    return (
        device.type == "cpu"
        and dtype in _DTYPES
        and head_dim in _HEAD_DIMS
        and 1 <= groups <= _MAX_GROUPS
        and load() is not None
    )


def paged_decode(
    q: torch.Tensor,
    blocks: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Decode attention ``[B, H, D]`` of ``q`` over the paged ``blocks``.

    ``blocks`` is one layer's ``[2, Hkv, num_blocks, block_size, D]`` cache, ``tables``
    ``[B, W]`` int64 block ids and ``lens`` ``[B]`` int64 context lengths (keys visible:
    the last ``window`` of them when ``window`` is set). Call it only where ``supports``
    said yes.
    """
    lib = load()
    if lib is None or blocks.dtype != q.dtype or not blocks.is_contiguous():
        raise RuntimeError("paged_decode called where the kernel does not apply")
    q = q.contiguous()
    tables = tables.contiguous()
    lens = lens.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = blocks.shape
    status = lib.tg_paged_decode(
        _DTYPES[q.dtype],
        q.data_ptr(),
        blocks.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        num_blocks,
        block_size,
        head_dim,
        tables.shape[1],
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"paged-attention kernel refused the shapes (status {status})")
    return out


HALF_LINEAR_DTYPES = (torch.bfloat16, torch.float16)


def supports_prefill(device: torch.device, dtype: torch.dtype, head_dim: int, groups: int) -> bool:
    """Whether ``paged_prefill`` runs here: ``supports`` for a bf16/fp16 cache on AVX2 (a
    float32 cache keeps torch's SDPA, the path greedy parity is measured on)."""
    return (
        dtype in HALF_LINEAR_DTYPES
        and supports(device, dtype, head_dim, groups)
        and has_half_linear()
    )


def paged_prefill(
    q: torch.Tensor,
    blocks: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Causal attention of the ``n`` query rows ``q`` ``[n, H, D]``, the last ``n`` positions
    of a sequence of ``context_len`` tokens, over its keys and values in the paged ``blocks``
    (one layer's ``[2, Hkv, num_blocks, block_size, D]``, this span's already written) at
    ``table`` (int64 block ids), into ``out`` ``[n, H, D]``. ``window``: each query sees its
    last ``window`` keys. Rows of ``q`` and ``out`` may be strided (views of wider rows); call
    it only where ``supports_prefill`` said yes."""
    lib = load()
    n, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = blocks.shape
    for t in (q, out):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise RuntimeError("paged_prefill: each row's heads must be contiguous")
    if lib is None or blocks.dtype != q.dtype or out.dtype != q.dtype or out.shape != q.shape:
        raise RuntimeError("paged_prefill called where the kernel does not apply")
    if not blocks.is_contiguous():
        raise RuntimeError("paged_prefill: the cache must be contiguous")
    table = table.contiguous()
    status = lib.tg_paged_prefill(
        _DTYPES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        blocks.data_ptr(),
        table.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        n,
        context_len,
        num_heads,
        num_kv_heads,
        num_blocks,
        block_size,
        head_dim,
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"prefill-attention kernel refused the shapes (status {status})")


def avx512_bf16() -> bool:
    """Whether the AVX-512 BF16 kernels run: bf16 decode attention and element-wise work
    (``*_avx512.cpp``), bf16 prefill attention in ``vdpbf16ps`` where AMX is off
    (``prefill_attention_bf16.cpp``) and the pair panels ``Gemm`` packs bf16 weights into
    (``pair_panels``). On where the CPU has AVX-512 BF16, unless ``TGENGINE_AVX512_BF16=0``
    is in the environment or ``set_avx512_bf16(False)`` was called."""
    lib = load()
    return lib is not None and lib.tg_use_avx512_bf16(-1) == 1


def set_avx512_bf16(on: bool) -> bool:
    """Turn the AVX-512 BF16 kernels on (only where the CPU has them) or off, process-wide,
    for comparisons and tests; returns whether they run now. Weights packed already keep
    their form: set it before a model packs them."""
    lib = load()
    return lib is not None and lib.tg_use_avx512_bf16(int(on)) == 1


@functools.cache
def has_half_linear() -> bool:
    """Whether ``half_linear`` runs here (the library built, and the CPU has AVX2/FMA/F16C)."""
    lib = load()
    return lib is not None and lib.tg_half_linear_available() == 1


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` and contiguous bf16/fp16 CPU tensors.

    Accumulates in float32 and rounds once (the order of the sums differs from oneDNN's). Call
    it only where ``has_half_linear()``; costs one pass over the weight per call.
    """
    weight = weight.contiguous()
    return _half_product("tg_half_linear", x, weight, weight.shape[0], bias)


PANEL = 16  # output rows side by side in one panel (half_linear.cpp's kPanel)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[n, k]`` as ``[ceil(n / 16), k, 16]`` panels (rows past ``n`` are zero)."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, k]`` weight ``pack_panels`` packed, exactly."""
    num_panels, k, width = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * width, k)[:rows].contiguous()


INT8_MAX = 127


def quantize_panels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[n, k]`` quantized to int8, one float32 scale per output row (symmetric:
    ``scale = max |row| / 127``, values rounded to nearest), packed as ``pack_panels`` packs.

    Returns ``(panels, scales)``; ``scales`` has one entry per panel row (zero past ``n``).
    """
    w = weight.float()
    scales = w.abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(w / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    panels = pack_panels(quantized)
    padded = torch.zeros(panels.shape[0] * PANEL, dtype=torch.float32)
    padded[: scales.shape[0]] = scales
    return panels, padded


def dequantize_rows(panels: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an int8 panel weight as float32 (``q * scale``), ``[len(ids), k]``."""
    return panels[ids // PANEL, :, ids % PANEL].float() * scales[ids][:, None]


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    rows: int,
    bias: torch.Tensor | None,
    *,
    float_output: bool = False,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``panels = pack_panels(weight)`` of ``rows`` rows.

    Any number of rows of ``x``; summed in float32 and rounded once, as ``half_linear``.
    ``float_output``: the same values stored as float32 (the result's ``.float()``, without
    a second pass over it: logits). ``scales``: the panels are ``quantize_panels``' int8
    ones, and these their row scales (``x``'s dtype is then bf16 or fp16).
    """
    if scales is not None:
        out_dtype = torch.float32 if float_output else None
        return _half_product("tg_panel_linear_q8", x, panels, rows, bias, out_dtype, scales)
    if float_output:
        return _half_product("tg_panel_linear_f32", x, panels, rows, bias, torch.float32)
    return _half_product("tg_panel_linear", x, panels, rows, bias)


def _half_product(
    kernel: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Runs ``kernel`` on a bf16/fp16 ``x``: ``weight`` in ``x``'s dtype, or int8 panels
    with their float32 ``scales`` (the q8 kernel, which takes them and a float-output flag)."""
    lib = load()
    weight_dtype = x.dtype if scales is None else torch.int8
    if lib is None or x.dtype not in HALF_LINEAR_DTYPES or weight.dtype != weight_dtype:
        raise RuntimeError(f"{kernel} called where the kernel does not apply")
    if not weight.is_contiguous():
        raise RuntimeError(f"{kernel}: the weight must be contiguous")
    if scales is not None and (not scales.is_contiguous() or scales.dtype != torch.float32):
        raise RuntimeError(f"{kernel}: the scales must be contiguous float32")
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=out_dtype or x.dtype)
    weights = [weight.data_ptr()] if scales is None else [weight.data_ptr(), scales.data_ptr()]
    flags = [] if scales is None else [int(out.dtype == torch.float32)]
    status = getattr(lib, kernel)(
        _DTYPES[x.dtype],
        x.data_ptr(),
        m,
        k,
        *weights,
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
        *flags,
    )
    if status != 0:
        raise RuntimeError(f"{kernel} refused the shapes (status {status})")
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.argmax(dim=-1)`` for 2-D float32 CPU logits, at memory speed; None where the
    kernel does not apply (no AVX2, another dtype or device, a row holding a NaN)."""
    if (
        logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or not has_half_linear()
    ):
        return None
    lib = load()
    assert lib is not None  # has_half_linear() loaded it
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.long)
    status = lib.tg_argmax_rows(
        logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out if status == 0 else None
