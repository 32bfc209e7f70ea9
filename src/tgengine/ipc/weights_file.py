"""Weights for the engine process: written once to a safetensors file it reads back.

A pickle per tensor would copy every tensor through the socket; a safetensors file in
``/dev/shm`` (memory, where it exists) is one sequential write here and a memory-mapped
read there.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHARED_MEMORY = Path("/dev/shm")


def write_weights_dir(named: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """A new directory holding ``model.safetensors`` with every ``(name, tensor)``.

    The caller removes it (``remove_weights_dir``). Tensors that share storage are
    copied, as safetensors requires.
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named:
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        tensors[name] = tensor
    parent = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="tgengine-weights-", dir=parent))
    try:
        save_file(tensors, str(path / "model.safetensors"))
    except BaseException:
        remove_weights_dir(path)
        raise
    return path


def remove_weights_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
