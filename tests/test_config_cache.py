"""Parsed model configs come back from the disk cache, exactly, and only for the same files."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from tgengine.models import config_cache, load_model_config

from model_factory import make_tiny_model_dir, read_config, write_config


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path / "cache"))


def _forbid_auto_config(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed again instead of read from the cache")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_second_load_reads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", arch)
    parsed = load_model_config(model_dir)
    assert len(list(config_cache.cache_dir().glob("*.pickle"))) == 1
    _forbid_auto_config(monkeypatch)
    assert load_model_config(model_dir) == parsed
    moved = shutil.copytree(model_dir, tmp_path / "elsewhere")  # same files, another place
    assert load_model_config(moved) == replace(parsed, model_dir=str(moved))


def test_an_edited_config_is_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    before = load_model_config(model_dir)
    raw = read_config(model_dir)
    raw["rms_norm_eps"] = 0.125
    write_config(model_dir, raw)
    after = load_model_config(model_dir)
    assert after.rms_norm_eps == 0.125 != before.rms_norm_eps
    (model_dir / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
    assert 7 in load_model_config(model_dir).eos_token_ids
    _forbid_auto_config(monkeypatch)
    assert 7 in load_model_config(model_dir).eos_token_ids  # that one is cached too


def test_a_broken_or_unwritable_cache_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    parsed = load_model_config(model_dir)
    (entry,) = config_cache.cache_dir().glob("*.pickle")
    entry.write_bytes(b"not a pickle")
    assert load_model_config(model_dir) == parsed  # parsed again, and stored again
    assert entry.read_bytes() != b"not a pickle"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TGENGINE_CACHE", str(blocker))  # cannot hold a directory
    assert load_model_config(model_dir) == parsed


def test_only_the_newest_entries_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_cache.CACHE, "max_entries", 2)
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama")
    raw = read_config(model_dir)
    for eps in (0.5, 0.25, 0.125):
        raw["rms_norm_eps"] = eps
        write_config(model_dir, raw)
        load_model_config(model_dir)
    assert len(list(config_cache.cache_dir().glob("*.pickle"))) == 2
