"""``TokenizerFacts``: whether transformers runs a directory's ``tokenizer.json`` as it is.

Loading a tokenizer through ``AutoTokenizer`` costs about two seconds of every start on a
small CPU: importing transformers scans its whole model registry (~1.4 s) and building the
tokenizer takes ~0.5 s more, where ``tokenizers.Tokenizer.from_file`` takes ~0.1 s. Which
class ``AutoTokenizer`` picks, and what that class changes in the file's pipeline (special
tokens it adds, a post-processor it rewrites, a pipeline it rebuilds for the model type,
spaces it cleans up), depends on transformers' version and on several files. So the
question is settled by transformers itself, once per directory and version: the first load
takes ``AutoTokenizer`` and compares it with the file (``facts_of``): the same pipeline,
the same ids and text on probes, the same chat prompts, no method of its own around them.
The answer, with the special tokens and the chat template transformers read, is kept in a
``DiskCache`` keyed by the tokenizer files and the versions; later starts of an exact
directory build a ``FastTokenizer`` from it without importing transformers.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import tokenizers

from ..runtime.disk_cache import DiskCache
from . import chat_template as chat_template_module
from . import fast_tokenizer as fast_tokenizer_module
from .chat_template import has_generation_tag
from .fast_tokenizer import TokenizerFacts

FORMAT = 1  # bump when TokenizerFacts or the checks change meaning
# Everything AutoTokenizer reads to choose and build a tokenizer (config.json: the model type).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# The methods between ``encode``/``decode`` and the pipeline: a class that overrides one
# does more than the file says.
PIPELINE_METHODS = (
    "__call__",
    "encode",
    "decode",
    "_decode",
    "_encode_plus",
    "_batch_encode_plus",
    "tokenize",
    "convert_ids_to_tokens",
    "_convert_id_to_token",
    "prepare_for_tokenization",
    "apply_chat_template",
)
PLAIN_BASES = ("TokenizersBackend", "PreTrainedTokenizerFast")
PROBE_TEXTS = (
    "Hello world! It 's a test , isn't it ?",
    "  spaces\tand\nnew lines  ",
    "ünïcödé 日本語 🤖",
)
PROBE_MESSAGES = (
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
)
PROBE_TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
)


CACHE = DiskCache(
    "tokenizers",
    format=FORMAT,
    files=TOKENIZER_FILES,
    libraries=("transformers", "tokenizers", "jinja2"),
    code=(fast_tokenizer_module, chat_template_module, sys.modules[__name__]),
)


def lookup(model_dir: Path) -> TokenizerFacts | None:
    facts = CACHE.lookup(model_dir)
    return facts if isinstance(facts, TokenizerFacts) else None


def store(model_dir: Path, facts: TokenizerFacts) -> None:
    CACHE.store(model_dir, facts)


def facts_of(hf: Any, model_dir: Path) -> TokenizerFacts:
    """Compare transformers' tokenizer ``hf`` of ``model_dir`` with its ``tokenizer.json``."""
    try:
        reason = _difference(hf, model_dir)
    except Exception as exc:  # a tokenizer unlike any tried: transformers keeps it, said why
        reason = f"could not compare ({type(exc).__name__}: {exc})"
    return TokenizerFacts(plain=False, reason=reason) if reason else _plain_facts(hf)


def _difference(hf: Any, model_dir: Path) -> str:
    """Why ``hf`` is not the file's pipeline alone ("" when it is)."""
    base = next((c for c in type(hf).__mro__ if c.__name__ in PLAIN_BASES), None)
    if base is None:
        return f"{type(hf).__name__} is not a tokenizers-backed class"
    own = [
        name
        for name in PIPELINE_METHODS
        if getattr(type(hf), name, None) is not getattr(base, name, None)
    ]
    if own:
        return f"{type(hf).__name__} has its own {', '.join(own)}"
    if getattr(hf, "split_special_tokens", False):
        return "split_special_tokens"
    if _cleans_up_spaces(hf):
        return "decoding cleans up spaces"
    template = hf.chat_template
    if template is not None and (not isinstance(template, str) or has_generation_tag(template)):
        return "several chat templates, or one that marks assistant tokens"
    try:
        file = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception (missing file, bad JSON)
        return f"tokenizer.json does not load: {exc}"
    theirs, ours = (fast_tokenizer_module.pipeline_json(t) for t in (hf.backend_tokenizer, file))
    if theirs != ours:
        return f"{type(hf).__name__} changes tokenizer.json's pipeline"
    fast = fast_tokenizer_module.FastTokenizer(str(model_dir), file, _plain_facts(hf))
    return _probe_difference(fast, hf)


def _plain_facts(hf: Any) -> TokenizerFacts:
    return TokenizerFacts(
        plain=True,
        special_tokens_map=dict(hf.special_tokens_map),
        model_max_length=int(hf.model_max_length),
        chat_template=hf.chat_template,
    )


def _probe_difference(fast: Any, hf: Any) -> str:
    """The first probe on which ``fast`` and ``hf`` disagree ("" when none does)."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(fast, name) != getattr(hf, name):
            return f"{name}: {getattr(fast, name)} != {getattr(hf, name)}"
    specials = [t for t in hf.special_tokens_map.values() if isinstance(t, str)]
    for text in (*PROBE_TEXTS, "".join(specials) + PROBE_TEXTS[0]):
        for add in (True, False):
            ids = list(hf.encode(text, add_special_tokens=add))
            if fast.encode(text, add_special_tokens=add) != ids:
                return f"encoding {text!r}"
            for skip in (True, False):
                if fast.decode(ids, skip_special_tokens=skip) != hf.decode(
                    ids, skip_special_tokens=skip
                ):
                    return f"decoding {text!r}"
    if fast.chat_template is not None:
        for tools in (None, list(PROBE_TOOLS)):
            messages = [dict(m) for m in PROBE_MESSAGES]
            theirs = _rendered(hf, messages, tools)
            if theirs != _rendered(fast, messages, tools):
                return "the chat template renders differently"
    return ""


def _rendered(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        )
    except Exception as exc:  # a template may refuse a conversation: then both must
        return f"<{type(exc).__name__}: {exc}>"


def _cleans_up_spaces(hf: Any) -> bool:
    """Whether ``hf.decode`` cleans up spaces (transformers 5 skips that for BPE models)."""
    if not getattr(hf, "clean_up_tokenization_spaces", False):
        return False
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    corrupt = getattr(
        hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return _transformers_major() < 5 or not bpe or bool(corrupt)


def _transformers_major() -> int:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0
