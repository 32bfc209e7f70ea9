"""The engine: ``Engine``, its step loop, requests and their streams, admission."""
