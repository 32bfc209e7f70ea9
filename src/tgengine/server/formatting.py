"""Turning engine chunks into OpenAI completion and chat bodies (streamed or whole)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from ..outputs import FinishReason, RequestOutput
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
    Usage,
)
from .structured_protocol import FunctionCallOut, ToolCallOut
from .tools import ToolOutput, new_call_id

UNLIKELY = -9999.0  # what OpenAI reports for a log probability that is -inf


@dataclass
class Accumulated:
    """Everything one request produced, for the non-streamed body and for usage."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, out: RequestOutput) -> None:
        if out.text:
            self.pieces.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.error = out.error

    def usage(self) -> Usage:
        completion = len(self.token_ids)
        prompt = self.num_prompt_tokens
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


class Formatter(Protocol):
    """The shape of one endpoint's bodies."""

    def opening(self) -> list[BaseModel]: ...
    def chunk(self, out: RequestOutput) -> BaseModel | None: ...
    def usage_chunk(self, usage: Usage) -> BaseModel: ...
    def whole(self, acc: Accumulated) -> BaseModel: ...


def _nothing_to_say(out: RequestOutput, logprobs: bool) -> bool:
    """A chunk without text (its token is an incomplete character) and without news."""
    return not (out.text or out.finished or (logprobs and out.token_ids))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY


class _Base:
    prefix = ""

    def __init__(self, model: str, tokenizer: Any, logprobs: bool) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]


class CompletionFormatter(_Base):
    prefix = "cmpl"

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(self, out: RequestOutput) -> BaseModel | None:
        if _nothing_to_say(out, self.want_logprobs):
            return None
        logprobs = self._logprobs(out.token_ids, out.logprobs) if self.want_logprobs else None
        choice = CompletionChoice(text=out.text, logprobs=logprobs, finish_reason=out.finish_reason)
        return self._response([choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._response([], usage)

    def whole(self, acc: Accumulated) -> BaseModel:
        logprobs = self._logprobs(acc.token_ids, acc.logprobs) if self.want_logprobs else None
        choice = CompletionChoice(text=acc.text, logprobs=logprobs, finish_reason=acc.finish_reason)
        return self._response([choice], acc.usage())

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None) -> CompletionLogprobs:
        tokens = self.token_texts(token_ids)
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        values = [_finite(v) for v in logprobs or []]
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, text_offset=offsets)


class ChatFormatter(_Base):
    """Chat bodies; with ``tools`` the answer is read as tool calls (see ``tools.py``)."""

    prefix = "chatcmpl"

    def __init__(
        self, model: str, tokenizer: Any, logprobs: bool, tools: ToolOutput | None = None
    ) -> None:
        super().__init__(model, tokenizer, logprobs)
        self.tools = tools

    def opening(self) -> list[BaseModel]:
        return [self._chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))]

    def chunk(self, out: RequestOutput) -> BaseModel | None:
        if self.tools is not None:
            return self._tool_chunk(out, self.tools)
        if _nothing_to_say(out, self.want_logprobs):
            return None
        logprobs = self._logprobs(out.token_ids, out.logprobs) if self.want_logprobs else None
        delta = ChatDelta(content=out.text) if out.text or not out.finished else ChatDelta()
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=out.finish_reason)
        return self._chunk(choice)

    def _tool_chunk(self, out: RequestOutput, tools: ToolOutput) -> BaseModel | None:
        deltas = tools.feed(out.text)
        if out.finished:
            end = tools.finish()
            deltas.content += end.content
            deltas.tool_calls += end.tool_calls
        news = deltas.content or deltas.tool_calls or out.finished
        if not news and not (self.want_logprobs and out.token_ids):
            return None
        logprobs = self._logprobs(out.token_ids, out.logprobs) if self.want_logprobs else None
        delta = ChatDelta(content=deltas.content or None, tool_calls=deltas.tool_calls or None)
        reason = _with_calls(out.finish_reason, tools)
        return self._chunk(ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=reason))

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def whole(self, acc: Accumulated) -> BaseModel:
        logprobs = self._logprobs(acc.token_ids, acc.logprobs) if self.want_logprobs else None
        message = AssistantMessage(content=acc.text)
        reason = acc.finish_reason
        if self.tools is not None:
            answer = self.tools.whole(acc.text)
            calls = [
                ToolCallOut(
                    id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments)
                )
                for c in answer.calls
            ]
            message = AssistantMessage(content=answer.content, tool_calls=calls)
            reason = _with_calls(reason, self.tools)
        choice = ChatChoice(message=message, logprobs=logprobs, finish_reason=reason)
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=acc.usage()
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None) -> ChatLogprobs:
        texts = self.token_texts(token_ids)
        content = [
            TokenLogprob(token=text, logprob=_finite(value), bytes=list(text.encode()))
            for text, value in zip(texts, logprobs or [], strict=False)
        ]
        return ChatLogprobs(content=content)


def _with_calls(reason: FinishReason | None, tools: ToolOutput) -> Any:
    """``stop`` becomes ``tool_calls`` once the answer made calls (``auto``, ``required``)."""
    if reason == "stop" and tools.made_calls:
        return tools.finish_reason_for_calls
    return reason
