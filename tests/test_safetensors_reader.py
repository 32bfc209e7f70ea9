"""tgengine's safetensors reader: the same tensors as the safetensors library, read in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tgengine.errors import ModelLoadError
from tgengine.models import iter_safetensors, iter_stored
from tgengine.models.safetensors_reader import stored_tensors


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5).to(torch.bfloat16),
        "b.weight": torch.randn(3),
        "c.half": torch.randn(2, 2, 2).to(torch.float16),
        "d.ids": torch.arange(6, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
    }


def test_reads_what_the_library_wrote(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file), metadata={"format": "pt"})
    want = load_file(str(file))
    got = {t.name: t.read() for t in stored_tensors(file)}
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_reads_into_the_destination_without_a_copy(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file))
    stored = {t.name: t for t in stored_tensors(file)}
    param = torch.empty(7, 5, dtype=torch.bfloat16)
    address = param.data_ptr()
    stored["a.weight"].copy_into(param)
    assert param.data_ptr() == address and torch.equal(param, _tensors()["a.weight"])
    widened = torch.empty(7, 5, dtype=torch.float32)  # another dtype: read, then cast
    stored["a.weight"].copy_into(widened)
    assert torch.equal(widened, _tensors()["a.weight"].float())


def test_sharded_directories_load_shard_by_shard(tmp_path: Path) -> None:
    tensors = _tensors()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(members, shard))
    import json

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    order = [(name, stored.file.name) for name, stored in iter_stored(tmp_path)]
    assert sorted(name for name, _ in order) == names
    assert [file for _, file in order] == sorted(file for _, file in order), (
        "one shard after the other"
    )
    assert {n: t for n, t in iter_safetensors(tmp_path)}.keys() == tensors.keys()


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_broken_file_is_a_model_load_error(tmp_path: Path, damage: str) -> None:
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file))
    data = file.read_bytes()
    file.write_bytes(data[:-8] if damage == "truncated" else b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match=r"cannot read model\.safetensors"):
        list(iter_safetensors(tmp_path))


def test_another_dtype_is_converted_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Narrowing float32 to bfloat16 in small chunks (a tail chunk too) equals one cast."""
    import tgengine.models.safetensors_reader as reader

    monkeypatch.setattr(reader, "_CHUNK_BYTES", 4 * 7)  # 7 float32 values a chunk
    full = torch.randn(9, 5)
    file = tmp_path / "model.safetensors"
    save_file({"w": full}, str(file))
    (stored,) = stored_tensors(file)
    narrow = torch.empty(9, 5, dtype=torch.bfloat16)
    address = narrow.data_ptr()
    stored.copy_into(narrow)
    assert narrow.data_ptr() == address and torch.equal(narrow, full.to(torch.bfloat16))
    rows = torch.empty(4, 5, dtype=torch.float16)
    stored.copy_slice_into(0, 3, 7, rows)
    assert torch.equal(rows, full[3:7].to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_slices_read_each_row_and_all_columns_read_at_once(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    full = torch.randn(6, 8)
    file = tmp_path / "model.safetensors"
    save_file({"w": full}, str(file))
    (stored,) = stored_tensors(file)
    columns = torch.empty(6, 3, dtype=dtype)
    stored.copy_slice_into(1, 2, 5, columns)
    assert torch.equal(columns, full[:, 2:5].to(dtype))
    every = torch.empty(6, 8, dtype=dtype)
    stored.copy_slice_into(1, 0, 8, every)
    assert torch.equal(every, full.to(dtype))
    inside = torch.zeros(6, 10, dtype=dtype)  # a destination that is not contiguous
    stored.copy_slice_into(1, 0, 8, inside[:, 1:9])
    assert torch.equal(inside[:, 1:9], full.to(dtype)) and not inside[:, [0, 9]].any()
