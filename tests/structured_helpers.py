"""Constraints and checks shared by the structured-output tests."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from tgengine import RequestOutput

# Bounded strings and no extra keys: a random tiny model at temperature 1 finishes them.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["person", "company"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)"
CHOICES = ("yes", "no", "maybe")
GRAMMAR = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
GRAMMAR_RE = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"

CASES: dict[str, dict[str, Any]] = {
    "json": {"json": PERSON},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": list(CHOICES)},
    "grammar": {"grammar": GRAMMAR},
}


def check_output(kind: str, text: str) -> None:
    """Assert that ``text`` matches the constraint of ``CASES[kind]``."""
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


def text_of(chunks: list[RequestOutput]) -> str:
    return "".join(c.text for c in chunks)
