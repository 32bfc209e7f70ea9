"""Parsed model configs kept on disk, so that a start need not import transformers' configs.

``load_model_config`` reads ``config.json`` through ``AutoConfig`` for transformers'
defaults and normalisations (RoPE parameters, layer types, ...). Importing a model's config
class costs a second or more (it pulls in ``torch.distributed.tensor`` and sympy), which was
a fifth of ``python -m tgengine generate``'s start. The result, a ``ModelConfig``, depends
only on ``config.json``, ``generation_config.json``, transformers' version and the code
that parses them (tgengine's modules that build it); it is kept in a ``DiskCache``
(``$TGENGINE_CACHE/model-configs/``) and read back on the next start.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tgengine.models import architectures, rope_params
from tgengine.models import config as config_module
from tgengine.models.config import ModelConfig
from tgengine.runtime.disk_cache import DiskCache

FORMAT = 1  # bump when ModelConfig or its parsing changes meaning
CACHE = DiskCache(
    "model-configs",
    format=FORMAT,
    files=("config.json", "generation_config.json"),
    libraries=("transformers",),
    # The code that turns those files into a ModelConfig: an edit to it is a new key (the
    # few lines of config_loader that join them change FORMAT instead).
    code=(architectures, config_module, rope_params),
)


def cache_dir() -> Path:
    return CACHE.directory()


def lookup(model_dir: Path) -> ModelConfig | None:
    """The config parsed earlier from these same files and versions, or None."""
    config = CACHE.lookup(model_dir)
    if not isinstance(config, ModelConfig):
        return None
    return replace(config, model_dir=str(model_dir))


def store(model_dir: Path, config: ModelConfig) -> None:
    """Keep ``config`` for the next ``lookup`` of the same files (best effort)."""
    CACHE.store(model_dir, replace(config, model_dir=""))
