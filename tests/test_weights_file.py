"""``ipc.weights_file``: a weights file that would not fit where it goes fails before a byte
is written, saying how much room there is; one written over counts its own pages."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tgengine.ipc import weights_file
from tgengine.ipc.weights_file import map_weights, write_weights_file


def named(rows: int) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64))]


def free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    def statvfs(path: object) -> SimpleNamespace:
        return SimpleNamespace(f_bavail=free, f_frsize=1)

    monkeypatch.setattr(weights_file.os, "statvfs", statvfs)


def test_a_file_that_does_not_fit_fails_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "model.safetensors"
    free_bytes(monkeypatch, 1000)
    with pytest.raises(OSError, match="MiB free") as caught:
        write_weights_file(named(16), file)  # 4 KiB of data
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(file)
    assert not file.exists()


def test_writing_over_a_file_counts_its_own_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / "model.safetensors"
    size = write_weights_file(named(16), file)
    assert os.path.getsize(file) == size
    free_bytes(monkeypatch, 0)
    assert write_weights_file(named(8), file) < size  # smaller: fits in what it has
    [(name, tensor)] = map_weights(file)
    assert name == "w" and torch.equal(tensor, named(8)[0][1])
    with pytest.raises(OSError, match="MiB more"):
        write_weights_file(named(32), file)  # larger than it was: no room
