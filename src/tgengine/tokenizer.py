"""Loading the tokenizer of a model directory (through ``AutoTokenizer``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelLoadError


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer`` from a local directory; never touches the network."""
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


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ready to generate.

    ``tools`` (OpenAI tool definitions) reach the template as its ``tools`` variable.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
