"""``load_model_config``: a model directory's ``ModelConfig``, from the disk cache or parsed.

The only place that talks to transformers' ``AutoConfig``. It sits above ``config`` (the
dataclasses and their parsing), ``architectures`` (what each architecture adds) and
``config_cache`` (configs parsed before), none of which import it back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tgengine.errors import ModelLoadError
from tgengine.models import config_cache
from tgengine.models.architectures import architecture_of, features
from tgengine.models.config import ModelConfig, build_config, one_line, read_json


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json`` (and ``generation_config.json`` if present), offline.

    Raises ``ModelLoadError`` with a one-line reason when the directory or its config is
    missing or broken, or when the model type or a feature of it is not supported. A config
    parsed before from the same files is read from the cache (``config_cache``) instead.
    """
    path = Path(model_dir)
    name = str(model_dir)
    raw = read_json(path, "config.json", required=True)
    architecture = architecture_of(raw, name)
    cached = config_cache.lookup(path)
    if cached is not None:
        return replace(cached, model_dir=name)
    model_type = str(raw["model_type"])
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; all mean "unreadable config"
        raise ModelLoadError(name, f"cannot read config.json: {one_line(exc)}") from exc
    try:
        base = build_config(hf, model_type, path)
        config = replace(base, architecture=architecture, **features(hf, architecture, base))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(name, f"config.json is incomplete: {one_line(exc)}") from exc
    config_cache.store(path, config)
    return config
