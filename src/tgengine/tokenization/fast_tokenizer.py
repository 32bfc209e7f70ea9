"""``FastTokenizer``: a model's ``tokenizer.json`` run by the tokenizers library directly.

For a directory whose transformers tokenizer is exactly its ``tokenizer.json`` (decided
once with transformers: ``tokenizer_facts``), this class gives transformers' ids, text and
chat prompts without importing transformers (two seconds of every start on a small CPU).
Calls and attributes it does not implement go to the transformers tokenizer of the same
directory, loaded on first use (``hf``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers

from .chat_template import PlainChatTemplate
from .hf_tokenizer import load_hf_tokenizer

# ``apply_chat_template`` arguments this class takes; any other goes to transformers.
CHAT_DEFAULTS: dict[str, Any] = {
    "documents": None,
    "chat_template": None,
    "continue_final_message": False,
    "sanitize_control_tokens": False,
    "padding": False,
    "truncation": False,
    "max_length": None,
    "return_tensors": None,
    "return_assistant_tokens_mask": False,
    "tokenizer_kwargs": None,
}


@dataclass(frozen=True)
class TokenizerFacts:
    """What a ``FastTokenizer`` needs besides ``tokenizer.json``, and whether it is exact
    (taken once with transformers: ``tokenizer_facts``).

    ``plain``: transformers' tokenizer of the directory is the file's pipeline and nothing
    more; ``reason`` says why not otherwise. The rest is what transformers read.
    """

    plain: bool
    reason: str = ""
    special_tokens_map: dict[str, Any] = field(default_factory=dict)
    model_max_length: int = 0
    chat_template: str | None = None


class FastTokenizer:
    """The part of a Hugging Face tokenizer's interface that tgengine uses, on ``tokenizers``.

    ``encode``, ``decode``, ``convert_ids_to_tokens``, ``apply_chat_template``, the special
    tokens and their ids, ``chat_template``, ``model_max_length`` and ``backend_tokenizer``
    behave as transformers' do for this directory. Anything else (``tokenizer(...)``,
    ``batch_decode``, ``save_pretrained``, ...) is the transformers tokenizer's, loaded on
    first use (``hf``); so is ``apply_chat_template`` with arguments this class does not take.
    """

    def __init__(self, path: str, backend: tokenizers.Tokenizer, facts: TokenizerFacts) -> None:
        backend.no_padding()
        backend.no_truncation()
        self.name_or_path = path
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(facts.special_tokens_map)
        self.model_max_length = facts.model_max_length
        self.chat_template = facts.chat_template
        self._template = PlainChatTemplate(facts.chat_template) if facts.chat_template else None
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.special_tokens_map.get("pad_token"))

    @property
    def is_fast(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs))
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        token_ids: int | Iterable[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        # This directory's own setting never cleans up (``tokenizer_facts``); asked for, or
        # with other arguments, transformers decodes.
        if kwargs or clean_up_tokenization_spaces:
            text = self.hf.decode(
                token_ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                **kwargs,
            )
            return str(text)
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | list[str | None] | None:
        if skip_special_tokens:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template`` for one conversation of plain dicts."""
        hf_only = {k: v for k, v in kwargs.items() if k in CHAT_DEFAULTS and v != CHAT_DEFAULTS[k]}
        plain = (
            self._template is not None and not hf_only and _is_one_plain_conversation(conversation)
        )
        plain = plain and all(isinstance(tool, dict) for tool in tools or ())
        if not plain:
            return self.hf.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=return_dict,
                **kwargs,
            )
        assert self._template is not None
        template_kwargs = {k: v for k, v in kwargs.items() if k not in CHAT_DEFAULTS}
        text = self._template.render(
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_kwargs},
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same directory (loaded once, on first use)."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = load_hf_tokenizer(self.name_or_path)
            return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)


def _is_one_plain_conversation(conversation: Any) -> bool:
    return (
        isinstance(conversation, list)
        and bool(conversation)
        and all(type(message) is dict for message in conversation)
    )


def pipeline_json(backend: tokenizers.Tokenizer) -> str:
    """A tokenizers pipeline as JSON, without its padding and truncation (which a prompt's
    ids do not depend on here), leaving ``backend`` itself unchanged."""
    config = json.loads(backend.to_str())
    config["padding"] = config["truncation"] = None
    return json.dumps(config)
