"""The OpenAI-compatible wire format: pydantic models for requests and responses.

Requests are strict (no type coercion, unknown fields rejected, numbers finite and
bounded) so that a bad request is a 400 that names its field, never a 500 further in.
Parameters tgengine cannot honour are accepted only at their neutral value (``n=1``,
``echo=false``, zero penalties, ...). The response models are what the OpenAPI schema
shows, and the handlers build every body from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .structured_protocol import (
    ResponseFormat,
    StructuredOutputsBody,
    ToolCall,
    ToolCallDelta,
    ToolCallOut,
    ToolChoice,
    ToolSpec,
)

MAX_TOKENS_LIMIT = 2**31 - 1
SEED_LIMIT = 2**63 - 1
MAX_STOP = 4

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


def _no_batches(value: object) -> object:
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise ValueError("batches of prompts are not supported; send one prompt per request")
        return value[0]
    return value


class SamplingFields(StrictModel):
    """The sampling parameters shared by completions and chat completions."""

    model: str
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: Literal[1] | None = Field(1, description="Only 1 is supported.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    frequency_penalty: float | None = Field(0.0, ge=0.0, le=0.0, description="Only 0.")
    presence_penalty: float | None = Field(0.0, ge=0.0, le=0.0, description="Only 0.")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    user: str | None = None
    top_k: int | None = Field(
        None, ge=-1, le=MAX_TOKENS_LIMIT, description="tgengine extension: 0 or -1 = off."
    )
    ignore_eos: bool | None = Field(False, description="tgengine extension.")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256)] | None = (
        Field(None, description="tgengine extension.")
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM's extra body: one of json, json_object, regex, choice, grammar."
    )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string or a list of token ids (a batch of exactly one is accepted too)."
    )
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(
        None, ge=0, le=0, description="0: the log probability of each sampled token."
    )
    echo: Literal[False] | None = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def unbatch_prompt(cls, value: object) -> object:
        return _no_batches(value)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's tool calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT, description="Deprecated.")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS_LIMIT, description="Default: the rest of the context."
    )
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only 0.")
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True


# -- responses --------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, object]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tgengine"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]
    state: str
    stalled: bool
    sleeping_tags: list[str]
    seconds_since_progress: float | None
    num_running: int
    num_waiting: int
    weight_version: int


class EngineStateResponse(BaseModel):
    state: str
    is_sleeping: bool
    sleeping_tags: list[str]
    weight_version: int


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


class UpdateWeightsRequest(StrictModel):
    path: str = Field(min_length=1, description="A server-side directory of *.safetensors.")
