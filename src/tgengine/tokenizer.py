"""Loading the tokenizer of a model directory (through ``AutoTokenizer``)."""

from __future__ import annotations

from typing import Any

from .errors import ModelLoadError


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer`` from a local directory; never touches the network."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"no usable tokenizer ({type(exc).__name__}: {exc})") from exc


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
