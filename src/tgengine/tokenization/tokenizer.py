"""Loading a model directory's tokenizer: ``FastTokenizer`` where exact, else ``AutoTokenizer``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from ..config import TOKENIZER_MODES
from . import tokenizer_facts
from .fast_tokenizer import CHAT_DEFAULTS, FastTokenizer, TokenizerFacts
from .hf_tokenizer import load_hf_tokenizer

# apply_chat_template's own arguments: given as template variables, they would change the
# call (tokenize, return_tensors, another template), not what the template reads.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict"}
    | set(CHAT_DEFAULTS)
)


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
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ready to generate.

    ``tools`` (OpenAI tool definitions) reach the template as its ``tools`` variable;
    ``template_kwargs`` (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``) as
    variables of their own. A key of ``apply_chat_template``'s own (``tokenize``,
    ``chat_template``, ...) is a ``ValueError``: it would change the call, not the template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    variables = dict(template_kwargs or {})
    reserved = sorted(set(variables) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: an argument of the call, not a template variable")
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        **variables,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
