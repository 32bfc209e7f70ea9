"""Options and helpers shared by the commands."""

from __future__ import annotations

import argparse
import sys

from ..config import TOKENIZER_MODES, EngineConfig
from ..errors import TGEngineError


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer). "
        "Default: SmolLM2-135M-Instruct, converted once into ~/.cache/tgengine",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and KV cache dtype; auto = the model config's (default: %(default)s)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        metavar="BYTES",
        help="KV cache budget in bytes (default: 512 MiB on CPU, free memory on CUDA)",
    )
    parser.add_argument(
        "--max-model-len", type=int, metavar="N", help="longest prompt + output in tokens"
    )
    parser.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, replace the linear weights by their packed form (oneDNN's, or "
        "tgengine's panels for bf16/fp16 on AVX2): faster products, still one copy "
        "(default: on)",
    )
    parser.add_argument(
        "--quantization",
        choices=["int8"],
        help="int8: the linear weights of a bf16/fp16 model on CPU as int8, one scale per "
        "output row (weight-only; docs/quantization.md); default: none",
    )
    parser.add_argument(
        "--tokenizer-mode",
        default="auto",
        choices=TOKENIZER_MODES,
        help="auto: run the model's tokenizer.json with the tokenizers library where "
        "transformers would run it unchanged, else AutoTokenizer; hf: always AutoTokenizer "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch threads on CPU (default: the count that ran a decode-like product "
        "fastest when the engine started; see docs/engine.md)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks that each hold a shard of the model (default: %(default)s)",
    )
    parser.add_argument(
        "--executor",
        choices=["uni", "mp", "ray"],
        help="what runs the ranks: uni (this process), mp (a worker process per rank) or "
        "ray (a Ray actor per rank); default: uni at size 1, mp above (docs/distributed.md)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the Ray cluster to join with --executor ray ('auto': the one on this machine; "
        "default: start a local Ray)",
    )
    parser.add_argument(
        "--backend",
        default="asyncio",
        choices=["asyncio", "trio"],
        help="the event loop to run on (default: %(default)s)",
    )


def resolve_model(model: str | None) -> str:
    """The model directory to use: ``--model``, or the default model (converted on first use)."""
    if model:
        return model
    from .default_model import ensure_default_model

    return str(ensure_default_model(progress=True))


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    return EngineConfig(
        model=resolve_model(args.model),
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        prepack_weights=args.prepack_weights,
        quantization=args.quantization,
        tokenizer_mode=args.tokenizer_mode,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        executor=args.executor,
        ray_address=args.ray_address,
        **overrides,  # type: ignore[arg-type]
    )


def fail(exc: BaseException) -> int:
    """Print a one-line error (with its cause) and return the exit status."""
    cause = exc.__cause__
    message = str(exc)
    if isinstance(exc, TGEngineError) and cause is not None and str(cause) not in message:
        message = f"{message} ({cause})"
    print(f"error: {message}", file=sys.stderr)
    return 1
