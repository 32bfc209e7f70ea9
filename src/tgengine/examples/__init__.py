"""Runnable examples of tgengine in the loops its users run (``python -m tgengine.examples.rl``)."""
