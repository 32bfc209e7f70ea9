"""Tokenization: loading a tokenizer, chat templates and incremental detokenization."""
