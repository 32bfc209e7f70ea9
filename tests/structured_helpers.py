"""Constraints and checks shared by the structured-output tests."""

from __future__ import annotations

import json
import random
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


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random object schema a random model can finish: strings and arrays are bounded,
    no extra keys; types, enums, consts, anyOf, nesting and optional keys vary."""
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        properties[f"k{i}"] = _random_value_schema(rng, depth)
    required = [k for k in properties if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _random_value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "pattern"]
    if depth < 2:
        kinds += ["array", "object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z][a-z]{1,4}-[0-9]{2}$"}
    if kind == "array":
        items = _random_value_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": 0, "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return random_schema(rng, depth + 1)
    return {"anyOf": [_random_value_schema(rng, depth + 1) for _ in range(2)]}
