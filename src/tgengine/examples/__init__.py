"""Examples of tgengine in the loops its users run; their scripts are in ``examples/``."""
