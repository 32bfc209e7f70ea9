"""Benchmarks: tgengine against transformers ``generate`` / ``generate_batch`` and the roofline.

Run them through ``python -m tgengine bench throughput | latency | lifecycle | batch32``. Each
module measures one thing and returns a plain dict (JSON-ready); ``report`` prints, saves and
plots those dicts. Speed is for reports only: nothing here asserts a number.
"""
