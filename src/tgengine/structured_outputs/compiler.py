"""``GrammarCompiler``: turns a constraint into a grammar for one tokenizer, with a cache.

The grammar library is llguidance (see docs/structured-outputs.md for why). Building its
view of the tokenizer costs up to a second for a 50k vocabulary, so it is done once per
engine, when the first constraint arrives (``Grammars``). A constraint compiles in about a
millisecond; the compiled matcher is cached by constraint (the compiler belongs to one
tokenizer, so the cache is keyed by (constraint, tokenizer)) and every request gets a copy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance

from ..errors import InvalidRequestError
from ..tokenization.fast_tokenizer import pipeline_json
from .matcher import GrammarMatcher
from .params import FIELD, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 256
# Compact JSON: a fixed separator and no free whitespace, so a model cannot loop on spaces.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe, cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        eos = list(eos_token_ids) or getattr(tokenizer, "eos_token_id", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured outputs need a fast tokenizer (a tokenizer.json)")
        # What llguidance.hf.from_tokenizer reads, for transformers' tokenizers and ours.
        self.ll_tokenizer = llguidance.LLTokenizer(
            pipeline_json(backend), n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        self._compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile_uncached)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``params``; ``InvalidRequestError`` if it does not compile."""
        return GrammarMatcher(self._compile(params).deep_copy())

    def cache_info(self) -> Any:
        return self._compile.cache_info()

    def _compile_uncached(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = _grammar(params)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(FIELD, f"{params.kind}: {_first_line(matcher.get_error())}")
        return matcher


def _grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; ``InvalidRequestError`` naming the problem."""
    kind = params.kind
    try:
        if params.json is not None:
            schema = json.loads(str(params.json))  # canonical text since __post_init__
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if params.json_object:
            schema = {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            lark = "start: " + " | ".join(json.dumps(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        assert params.grammar is not None
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidRequestError(FIELD, f"{kind}: {_first_line(str(exc))}") from exc


def _first_line(message: str) -> str:
    """llguidance appends its internal state to errors; the first lines say what is wrong."""
    return message.split("\n<state>")[0].strip()
