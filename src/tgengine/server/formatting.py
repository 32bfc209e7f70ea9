"""Turning engine chunks into OpenAI completion and chat bodies (streamed or whole)."""

from __future__ import annotations

import copy
import math
import time
import uuid
from typing import Any, Protocol

from pydantic import BaseModel

from ..outputs import FinishReason, RequestOutput
from .choices import Choice, usage
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .structured_protocol import FunctionCallOut, ToolCallOut
from .tools import ToolOutput, new_call_id

UNLIKELY = -9999.0  # what OpenAI reports for a log probability that is -inf


class Formatter(Protocol):
    """The shape of one endpoint's bodies."""

    def opening(self, choices: list[Choice]) -> list[BaseModel]: ...
    def chunk(self, choice: Choice, out: RequestOutput) -> BaseModel | None: ...
    def usage_chunk(self, usage: Usage) -> BaseModel: ...
    def whole(self, choices: list[Choice]) -> BaseModel: ...


def _finite(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY


class _Base:
    prefix = ""

    def __init__(self, model: str, tokenizer: Any, logprobs: int | None) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # None: none; k: the sampled token's and k alternatives
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def has_news(self, out: RequestOutput) -> bool:
        """Whether a chunk is worth an event: text, a finish, or tokens whose logprobs count."""
        return bool(out.text or out.finished or (self.logprobs is not None and out.token_ids))


class CompletionFormatter(_Base):
    prefix = "cmpl"

    def opening(self, choices: list[Choice]) -> list[BaseModel]:
        return []

    def chunk(self, choice: Choice, out: RequestOutput) -> BaseModel | None:
        first = choice.num_chunks == 1 and choice.echo is not None
        if not (first or self.has_news(out)):
            return None
        text = (choice.echo or "") + out.text if first else out.text
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._logprobs(choice, out.token_ids, out.logprobs, out.top_logprobs, first)
        return self._response(
            [
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    weight_version=out.weight_version,
                )
            ]
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._response([], usage)

    def whole(self, choices: list[Choice]) -> BaseModel:
        body = []
        for choice in choices:
            choice.sent_chars = 0
            logprobs = None
            if self.logprobs is not None:
                logprobs = self._logprobs(
                    choice,
                    choice.token_ids,
                    choice.logprobs,
                    choice.top_logprobs,
                    choice.echo is not None,
                )
            body.append(
                CompletionChoice(
                    index=choice.index,
                    text=choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    weight_versions=choice.versions,
                )
            )
        return self._response(body, usage(choices))

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(
        self,
        choice: Choice,
        token_ids: list[int],
        logprobs: list[float] | None,
        tops: list[dict[int, float]] | None,
        with_prompt: bool,
    ) -> CompletionLogprobs:
        ids: list[int] = []
        values: list[float | None] = []
        alternatives: list[dict[int, float] | None] = []
        if with_prompt:
            ids += choice.prompt_token_ids
            values += choice.prompt_logprobs or [None] * len(choice.prompt_token_ids)
            alternatives += choice.prompt_top_logprobs or [None] * len(choice.prompt_token_ids)
        ids += token_ids
        values += logprobs if logprobs is not None else [None] * len(token_ids)
        alternatives += tops if tops is not None else [None] * len(token_ids)
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(choice.sent_chars)
            choice.sent_chars += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if v is None else _finite(v) for v in values],
            top_logprobs=[
                self._top(t, v, top) for t, v, top in zip(ids, values, alternatives, strict=True)
            ],
            text_offset=offsets,
        )

    def _top(
        self, token: int, value: float | None, top: dict[int, float] | None
    ) -> dict[str, float] | None:
        """The alternatives and the token itself (as vLLM does: ``logprobs=0`` gives just it)."""
        if value is None:
            return None
        entries = {self.token_text(t): _finite(v) for t, v in (top or {}).items()}
        entries.setdefault(self.token_text(token), _finite(value))
        return entries


class ChatFormatter(_Base):
    """Chat bodies; with ``tools`` each choice's answer is read as tool calls (``tools.py``)."""

    prefix = "chatcmpl"

    def __init__(
        self, model: str, tokenizer: Any, logprobs: int | None, tools: ToolOutput | None = None
    ) -> None:
        super().__init__(model, tokenizer, logprobs)
        self.tools = tools
        self._tools: dict[int, ToolOutput] = {}  # each choice reads its own answer

    def _tools_of(self, choice: Choice) -> ToolOutput | None:
        if self.tools is None:
            return None
        if choice.index not in self._tools:
            self._tools[choice.index] = copy.deepcopy(self.tools)
        return self._tools[choice.index]

    def opening(self, choices: list[Choice]) -> list[BaseModel]:
        return [
            self._chunk(
                ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
            )
            for c in choices
        ]

    def chunk(self, choice: Choice, out: RequestOutput) -> BaseModel | None:
        tools = self._tools_of(choice)
        if tools is not None:
            return self._tool_chunk(choice, out, tools)
        if not self.has_news(out):
            return None
        logprobs = self._logprobs(out.token_ids, out.logprobs, out.top_logprobs)
        delta = ChatDelta(content=out.text) if out.text or not out.finished else ChatDelta()
        return self._chunk(
            ChatChunkChoice(
                index=choice.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=out.finish_reason,
                weight_version=out.weight_version,
            )
        )

    def _tool_chunk(
        self, choice: Choice, out: RequestOutput, tools: ToolOutput
    ) -> BaseModel | None:
        deltas = tools.feed(out.text)
        if out.finished:
            end = tools.finish()
            deltas.content += end.content
            deltas.tool_calls += end.tool_calls
        news = deltas.content or deltas.tool_calls or out.finished
        if not news and not (self.logprobs is not None and out.token_ids):
            return None
        logprobs = self._logprobs(out.token_ids, out.logprobs, out.top_logprobs)
        delta = ChatDelta(content=deltas.content or None, tool_calls=deltas.tool_calls or None)
        reason = _with_calls(out.finish_reason, tools)
        return self._chunk(
            ChatChunkChoice(
                index=choice.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=reason,
                weight_version=out.weight_version,
            )
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, choices: list[Choice]) -> BaseModel:
        body = [self._whole_choice(c) for c in choices]
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=body, usage=usage(choices)
        )

    def _whole_choice(self, choice: Choice) -> ChatChoice:
        message = AssistantMessage(content=choice.text)
        reason: Any = choice.finish_reason
        tools = self._tools_of(choice)
        if tools is not None:
            answer = tools.whole(choice.text)
            calls = [
                ToolCallOut(
                    id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)
                )
                for c in answer.calls
            ]
            message = AssistantMessage(content=answer.content, tool_calls=calls)
            reason = _with_calls(reason, tools)
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=self._logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs),
            finish_reason=reason,
            weight_versions=choice.versions,
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float] | None,
        tops: list[dict[int, float]] | None,
    ) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for i, (token, value) in enumerate(zip(token_ids, logprobs or [], strict=False)):
            top = (tops or [])[i] if tops and i < len(tops) else {}
            content.append(
                TokenLogprob(
                    **self._entry(token, value),
                    top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in top.items()],
                )
            )
        return ChatLogprobs(content=content)

    def _entry(self, token: int, value: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode())}


def _with_calls(reason: FinishReason | None, tools: ToolOutput) -> Any:
    """``stop`` becomes ``tool_calls`` once the answer made calls (``auto``, ``required``)."""
    if reason == "stop" and tools.made_calls:
        return tools.finish_reason_for_calls
    return reason
