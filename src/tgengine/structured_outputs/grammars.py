"""``Grammars``: an engine's ``GrammarCompiler``, built when the first constraint needs it.

Building llguidance's view of the tokenizer reads the whole vocabulary (about a second for
SmolLM2's 49k tokens). An engine that never sees a constraint should not wait for it at
start-up, so the compiler is built on first use, once, under a lock: ``prepare`` (what a
server calls in a worker thread) builds it off the event loop; a constrained ``generate``
without a ``prepare`` before it builds it there, once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidRequestError
from .compiler import GrammarCompiler
from .matcher import GrammarMatcher
from .params import FIELD, StructuredOutputsParams


class Grammars:
    """Matchers for constraints against one tokenizer; the compiler comes on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(eos_token_ids))
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | str | None = None  # str: why there is none

    def matcher(self, constraint: StructuredOutputsParams | None) -> GrammarMatcher | None:
        """A fresh matcher for ``constraint`` (None: no constraint, no matcher).

        ``InvalidRequestError`` when it does not compile, or this tokenizer cannot have one.
        """
        if constraint is None:
            return None
        return self.compiler().matcher(constraint)

    def compiler(self) -> GrammarCompiler:
        """The compiler, built now if it was not; ``InvalidRequestError`` if there is none."""
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = GrammarCompiler(*self._args)
                except ValueError as exc:
                    self._compiler = str(exc)
            compiler = self._compiler
        if isinstance(compiler, str):
            raise InvalidRequestError(FIELD, compiler)
        return compiler

    def cache_info(self) -> Any:
        """The compiled-constraint cache's counters (``functools.lru_cache`` style)."""
        return self.compiler().cache_info()
