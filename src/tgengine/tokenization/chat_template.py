"""``PlainChatTemplate``: a model's Jinja chat template, rendered as transformers renders it.

transformers compiles a chat template in a sandboxed Jinja environment (blocks trimmed,
``loopcontrols``, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``, namespaces that refuse underscore names) and renders it with the
messages (``None`` fields dropped, a reasoning field also given as ``thinking`` and
``reasoning_content``), the tools, ``add_generation_prompt`` and the special tokens. This
module does the same for one conversation of plain dicts, so that a start needs no
transformers import (``FastTokenizer``). Templates with the ``{% generation %}`` tag (for
assistant masks) and directories with several templates are left to transformers.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tag(source: str) -> bool:
    """Whether a template marks assistant tokens (``{% generation %}``, transformers only)."""
    return _GENERATION_TAG.search(source) is not None


class PlainChatTemplate:
    """One template, compiled on first use (a template that does not compile fails there)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        **variables: Any,
    ) -> str:
        return _compile(self.source).render(
            messages=[_message(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def _message(message: dict[str, Any]) -> dict[str, Any]:
    plain = {key: value for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return _environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandbox (jinja2 is imported here, on the first render: 0.2 s off every start)."""
    import jinja2.ext
    import jinja2.sandbox
    import jinja2.utils

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r}")

    class Namespace(jinja2.utils.Namespace):
        """Jinja's ``namespace``, refusing underscore names as transformers' does."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = Namespace
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
