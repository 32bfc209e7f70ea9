"""Load safetensors checkpoints into a ``CausalLM`` by Hugging Face parameter name."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tgengine.errors import ModelLoadError
from tgengine.models.causal_lm import CausalLM
from tgengine.models.config import ModelConfig, resolve_dtype
from tgengine.models.safetensors_reader import StoredTensor, stored_tensors
from tgengine.models.shard import Shard
from tgengine.runtime.parallel import ParallelContext

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Checkpoint tensors that hold no learned state of ours (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu_tensor)`` for every tensor of the directory's safetensors files.

    Reads ``model.safetensors.index.json`` shards if present, else ``model.safetensors``, else
    every ``*.safetensors`` file. Raises ``ModelLoadError`` when there is none.
    """
    for name, stored in iter_stored(model_dir):
        yield name, _read(stored, model_dir)


def iter_stored(model_dir: str | Path) -> Iterator[tuple[str, StoredTensor]]:
    """Like ``iter_safetensors``, but nothing is read yet: shard by shard, tensor by tensor."""
    for file in _safetensors_files(Path(model_dir)):
        try:
            stored = list(stored_tensors(file))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise _unreadable(model_dir, file, exc) from exc
        for tensor in stored:
            yield tensor.name, tensor


def _read(
    stored: StoredTensor,
    model_dir: str | Path,
    into: torch.Tensor | None = None,
    shard: Shard | None = None,
) -> torch.Tensor:
    try:
        if into is None:
            return stored.read()
        if shard is None:
            stored.copy_into(into)
        else:
            shard.read_into(stored, into)
        return into
    except (OSError, ValueError) as exc:
        raise _unreadable(model_dir, stored.file, exc) from exc


def _unreadable(model_dir: str | Path, file: Path, exc: Exception) -> ModelLoadError:
    reason = f"cannot read {file.name}: {type(exc).__name__}: {exc}".splitlines()[0]
    return ModelLoadError(str(model_dir), reason)


def load_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    parallel: ParallelContext | None = None,
) -> CausalLM:
    """Build a ``CausalLM`` on ``device`` in ``dtype`` and fill every parameter from disk.

    ``dtype`` may be a string as ``resolve_dtype`` takes it ("auto", "bfloat16", ...).
    With ``parallel``, the model of that rank: only its shard of each tensor is read.
    Raises ``ModelLoadError`` for a missing, unexpected or wrongly shaped tensor, or a
    model that does not split over the tensor-parallel size.
    """
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, config)
    try:
        with torch.device("meta"):
            model = CausalLM(config, parallel)
    except ValueError as exc:  # a size that does not split over the ranks
        raise ModelLoadError(str(model_dir), f"tensor parallelism: {exc}") from exc
    # On meta these casts cost nothing; then each parameter is allocated once. Not with
    # ``to_empty``: its ``empty_like`` of a meta tensor runs torch's Python reference
    # implementation, whose imports (torch.fx's symbolic shapes, sympy) cost 0.6 s a start.
    model.to(dtype=dtype)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    load_weights(model, iter_stored(model_dir), strict=True, source=str(model_dir))
    return model.eval()


def weight_specs(model: CausalLM) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{checkpoint name: (full shape, dtype)}`` of every parameter the model loads.

    Full: the checkpoint's shape, also where this rank holds only a shard of it.
    """
    shards = model.weight_shards
    return {name: (shards[name].full_shape, p.dtype) for name, p in model.named_parameters()}


def load_weights(
    model: CausalLM,
    named_tensors: Iterable[tuple[str, torch.Tensor | StoredTensor]],
    *,
    strict: bool,
    source: str = "weights",
) -> set[str]:
    """Copy tensors into the model's parameters in place (cast to their dtype and device).

    A ``StoredTensor`` (``iter_stored``) is read from disk straight into its parameter, and
    only the parameter's shard of it (``CausalLM.weight_shards``); a tensor is the full one.

    Returns the names loaded. Names like ``rotary_emb.inv_freq`` are ignored, and so is
    ``lm_head.weight`` when the model ties it to the embedding. With ``strict``, every
    parameter must be given. Raises ``ModelLoadError(source, ...)`` naming an unexpected
    tensor, a wrong shape, or (strict) the missing ones; tensors copied before the error stay
    copied, so validate against ``weight_specs`` first when a partial update is unacceptable.
    """
    params = dict(model.named_parameters())
    shards = model.weight_shards
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.lm_head is None:
                continue
            param = params.get(name)
            if param is None:
                raise ModelLoadError(source, f"unexpected tensor {name!r}")
            shard = shards[name]
            if tensor.shape != shard.full_shape:
                raise ModelLoadError(
                    source,
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(shard.full_shape)}",
                )
            if isinstance(tensor, StoredTensor):
                _read(tensor, source, into=param, shard=shard)
            else:
                shard.copy_into(tensor, param)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if strict and missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        names = ", ".join(repr(n) for n in missing[:3])
        raise ModelLoadError(source, f"missing tensor {names}{more}")
    return loaded


def _safetensors_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise ModelLoadError(str(model_dir), "directory does not exist")
    index = model_dir / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(str(model_dir), f"{_INDEX} is broken: {exc}") from exc
        files = [model_dir / shard for shard in shards]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(
                    str(model_dir), f"shard {file.name} listed in {_INDEX} is missing"
                )
        return files
    if (model_dir / _SINGLE).is_file():
        return [model_dir / _SINGLE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(model_dir), "no *.safetensors weights found")
    return files
