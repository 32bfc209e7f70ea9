"""The dev runner: ``python -m tgengine generate | serve | bench``."""
