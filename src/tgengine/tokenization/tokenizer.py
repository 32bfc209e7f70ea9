"""Loading a model directory's tokenizer: ``FastTokenizer`` where exact, else ``AutoTokenizer``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from ..config import TOKENIZER_MODES
from ..errors import ModelLoadError
from . import tokenizer_facts
from .fast_tokenizer import FastTokenizer


def load_tokenizer(path: str, mode: str = "auto") -> Any:
    """The tokenizer of a local model directory; never touches the network.

    ``mode="auto"``: a ``FastTokenizer`` (the tokenizers library alone, ~0.1 s) where an
    earlier load found transformers' tokenizer to be exactly the directory's
    ``tokenizer.json`` (``tokenizer_facts``), else transformers' ``AutoTokenizer`` (~2 s,
    mostly its import), compared with the file for the next load. ``mode="hf"``: always
    ``AutoTokenizer``.
    """
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer mode: must be one of {TOKENIZER_MODES}, got {mode!r}")
    if mode == "hf":
        return load_hf_tokenizer(path)
    root = Path(path)
    facts = tokenizer_facts.lookup(root)
    if facts is not None and facts.plain and (fast := _fast_tokenizer(path, facts)) is not None:
        return fast
    hf = load_hf_tokenizer(path)
    if facts is None:
        tokenizer_facts.store(root, tokenizer_facts.facts_of(hf, root))
    return hf


def _fast_tokenizer(path: str, facts: tokenizer_facts.TokenizerFacts) -> FastTokenizer | None:
    if (Path(path) / "additional_chat_templates").exists():  # added since the facts were taken
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    except Exception:  # tokenizers raises a bare Exception; AutoTokenizer then says what is wrong
        return None
    return FastTokenizer(path, backend, facts)


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
