"""Argument parsing for ``python -m tgengine``; each command lives in its own module."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from . import generate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tgengine",
        description="tgengine: run Llama-family models with a lifecycle nobody can break.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(commands)
    for name in ("serve", "bench"):
        module = _optional_command(name)
        if module is not None:
            module.add_parser(commands)
    return parser


def _optional_command(name: str) -> ModuleType | None:
    import importlib

    try:
        return importlib.import_module(f"tgengine.cli.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"tgengine.cli.{name}":
            raise
        return None


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Warnings from everywhere; one-time progress lines (a kernel compiling) from tgengine.
    logging.basicConfig(format="%(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("tgengine.kernels").setLevel(logging.INFO)
    sys.exit(args.handler(args))
