"""``StructuredOutputsParams``: the one constraint a request's output must match."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..errors import InvalidRequestError

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (Lark or GBNF/EBNF).

    As in vLLM. ``json`` may be given as a dict or as its JSON text; it is kept as
    canonical JSON text so that equal schemas share one compiled grammar. JSON output is
    compact (no whitespace between tokens), which keeps small models from looping on
    whitespace. Whether a schema, regex or grammar is valid is checked at admission,
    when it is compiled against the tokenizer (``InvalidRequestError`` naming the problem).
    """

    json: str | dict[str, Any] | None = None  # kept as canonical JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                FIELD, f"json_object must be a bool, got {self.json_object!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(FIELD, f"{name} must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                FIELD, f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """``value`` as params: None, params, or a mapping of their fields (vLLM's body)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                FIELD, f"must be StructuredOutputsParams or a dict, not {value!r}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(FIELD, f"unknown keys {unknown}; known: {list(KINDS)}")
        return cls(**dict(value))


def _canonical_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(FIELD, f"json: the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidRequestError(FIELD, "json: a JSON schema is an object (or true/false)")
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(FIELD, f"json: the schema is not JSON: {exc}") from exc


def _choices(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise InvalidRequestError(FIELD, "choice must be a list of strings")
    items = tuple(choice)
    if not items or not all(isinstance(c, str) and c for c in items):
        raise InvalidRequestError(FIELD, "choice must be a non-empty list of non-empty strings")
    return items
