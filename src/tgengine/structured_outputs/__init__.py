"""Structured outputs: constrained decoding to a JSON schema, regex, choice or grammar.

``StructuredOutputsParams`` (in ``SamplingParams.structured_outputs``) names the
constraint; ``GrammarCompiler`` compiles it against the tokenizer at admission (built on
first use by ``Grammars``);
each constrained sequence keeps a ``GrammarMatcher``; the engine loop fills the step's
token bitmasks (``fill_bitmasks``) and the sampler applies them (``GrammarMask``).
"""

from __future__ import annotations

from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
