"""Parsed model configs kept on disk, so that a start need not import transformers' configs.

``load_model_config`` reads ``config.json`` through ``AutoConfig`` for transformers'
defaults and normalisations (RoPE parameters, layer types, ...). Importing a model's config
class costs a second or more (it pulls in ``torch.distributed.tensor`` and sympy), which was
a fifth of ``python -m tgengine generate``'s start. The result, a ``ModelConfig``, depends
only on ``config.json``, ``generation_config.json``, transformers' version and the code
that parses them (tgengine's modules that build it); it is stored under
``$TGENGINE_CACHE/model-configs/`` (default ``~/.cache/tgengine``), keyed by a hash of
exactly those, and read back on the next start.

The entries are pickles written by this process's user, the same trust as the compiled
kernels beside them. A cache that cannot be read or written is skipped: the config is then
parsed as usual. At most ``MAX_ENTRIES`` entries are kept (the oldest go first).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from dataclasses import replace
from pathlib import Path

from tgengine.models import architectures, rope_params
from tgengine.models import config as config_module
from tgengine.models.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = 1  # bump when ModelConfig or its parsing changes meaning
MAX_ENTRIES = 256
_FILES = ("config.json", "generation_config.json")
# The code that turns those files into a ModelConfig: an edit to it is a new key.
_PARSERS = (architectures, config_module, rope_params)


def cache_dir() -> Path:
    root = os.environ.get("TGENGINE_CACHE") or "~/.cache/tgengine"
    return Path(root).expanduser() / "model-configs"


def lookup(model_dir: Path) -> ModelConfig | None:
    """The config parsed earlier from these same files and versions, or None."""
    entry = _entry(model_dir)
    if entry is None or not entry.is_file():
        return None
    try:
        config = pickle.loads(entry.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        log.info("ignoring unreadable model-config cache entry %s: %s", entry, exc)
        return None
    if not isinstance(config, ModelConfig):
        return None
    return replace(config, model_dir=str(model_dir))


def store(model_dir: Path, config: ModelConfig) -> None:
    """Keep ``config`` for the next ``lookup`` of the same files (best effort)."""
    entry = _entry(model_dir)
    if entry is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(pickle.dumps(replace(config, model_dir="")))
        os.replace(temp, entry)
        _prune(entry.parent)
    except OSError as exc:
        log.info("not caching the model config of %s: %s", model_dir, exc)


def _entry(model_dir: Path) -> Path | None:
    digest = hashlib.sha256(f"format {FORMAT}\n".encode())
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    digest.update(f"transformers {version}\n".encode())
    try:
        for module in _PARSERS:
            digest.update(Path(str(module.__file__)).read_bytes())
        for name in _FILES:
            path = model_dir / name
            data = path.read_bytes() if path.exists() else None
            digest.update(f"{name} {'-' if data is None else len(data)}\n".encode())
            digest.update(data or b"")
    except OSError:
        return None
    return cache_dir() / f"{digest.hexdigest()}.pickle"


def _prune(directory: Path) -> None:
    entries = sorted(directory.glob("*.pickle"), key=lambda p: p.stat().st_mtime)
    for old in entries[: max(0, len(entries) - MAX_ENTRIES)]:
        old.unlink(missing_ok=True)
