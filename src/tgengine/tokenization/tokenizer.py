"""Loading a model directory's tokenizer: ``FastTokenizer`` where exact, else ``AutoTokenizer``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from ..config import TOKENIZER_MODES
from . import tokenizer_facts
from .fast_tokenizer import FastTokenizer, TokenizerFacts
from .hf_tokenizer import load_hf_tokenizer


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


def _fast_tokenizer(path: str, facts: TokenizerFacts) -> FastTokenizer | None:
    if (Path(path) / "additional_chat_templates").exists():  # added since the facts were taken
        return None
    try:
        backend = tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    except Exception:  # tokenizers raises a bare Exception; AutoTokenizer then says what is wrong
        return None
    return FastTokenizer(path, backend, facts)


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
