"""``load_hf_tokenizer``: transformers' ``AutoTokenizer`` of a local model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError


def load_hf_tokenizer(path: str) -> Any:
    """``AutoTokenizer`` from a local directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **_plain_config(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"no usable tokenizer ({type(exc).__name__}: {exc})") from exc


def _plain_config(path: str) -> dict[str, Any]:
    """``{"config": ...}`` when ``AutoTokenizer`` can choose without the model's config class.

    Left alone, ``AutoTokenizer`` reads ``config.json`` through the model's own config class,
    whose import pulls in ``torch.distributed.tensor`` and sympy: about a second of every
    start. When ``tokenizer_config.json`` names its tokenizer class and brings no remote code,
    the choice reads only strings of ``config.json`` (model type, names), which a plain
    ``PreTrainedConfig`` carries too. Anything else gets the usual path.
    """
    try:
        declared = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(declared, dict) or not declared.get("tokenizer_class"):
        return {}
    if "auto_map" in declared:
        return {}
    from transformers import PreTrainedConfig

    try:
        raw, _ = PreTrainedConfig.get_config_dict(path, local_files_only=True)
    except (OSError, ValueError):
        return {}
    if "auto_map" in raw:
        return {}
    return {"config": PreTrainedConfig.from_dict(raw)}
