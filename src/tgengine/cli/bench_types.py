"""The argument types of ``python -m tgengine bench``'s options (``cli.bench``)."""

from __future__ import annotations

import argparse
from typing import Any

SYSTEMS = "tgengine,hf_generate,hf_generate_batch"


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def system_list(text: str) -> tuple[str, ...]:
    known = SYSTEMS.split(",")
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in known]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"systems: choose from {SYSTEMS}, got {text!r}")
    return values


def thread_count(text: str) -> str | int:
    if text == "auto":
        return text
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("threads: must be 'auto' or a positive integer")
    return value


def peer_spec(text: str) -> Any:
    from ..bench.peers import PeerSpecError, parse_peer

    try:
        return parse_peer(text)
    except PeerSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def peer_thread_counts(text: str) -> Any:
    from ..bench.peers import PeerSpecError, parse_threads

    try:
        return parse_threads(text)
    except PeerSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
