"""The OpenAI-compatible wire format: pydantic models for requests and responses.

Requests are strict (no type coercion, unknown fields rejected, numbers finite and
bounded) so that a bad request is a 400 that names its field, never a 500 further in.
Every parameter OpenAI's API and vLLM's server take for a text model is here, with
OpenAI's ranges; the few tgengine cannot honour (``suffix``) are accepted only at their
neutral value. The response models are what the OpenAPI schema shows, and the handlers
build every body from them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import MAX_LOGPROBS, MAX_N
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
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # any int64 seed, as OpenAI and vLLM take
MAX_STOP = 4
MAX_PROMPTS = 64  # prompts in one completions batch

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]  # a prompt or stop string: never empty


class SamplingFields(StrictModel):
    """The sampling parameters shared by completions and chat completions."""

    model: str
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=MAX_N, description=f"Sequences per prompt (1..{MAX_N}).")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)]
        | None
    ) = Field(None, description="Token id (a string of digits) -> bias added to its logit.")
    user: str | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT, description="vLLM: 0 or -1 = off.")
    repetition_penalty: float | None = Field(
        1.0, gt=0.0, le=2.0, description="vLLM: > 1 discourages tokens of prompt and output."
    )
    min_tokens: int | None = Field(0, ge=0, le=MAX_TOKENS_LIMIT, description="vLLM: no EOS before.")
    ignore_eos: bool | None = Field(False, description="vLLM extension.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = Field(
        None, description="vLLM extension."
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM's extra body: one of json, json_object, regex, choice, grammar."
    )


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[
            list[Annotated[list[int], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ]
    ) = Field(description="A string, a list of token ids, or a batch of either.")
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Log probability of each token and of this many most likely ones.",
    )
    echo: bool | None = Field(False, description="Return the prompt before the completion.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Must equal n when set.")
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per entry."""
        prompt = self.prompt
        if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]  # narrowed: a str or list[int]
        return list(prompt)  # type: ignore[arg-type]  # narrowed: a batch


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
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Most likely tokens per position; needs logprobs."
    )
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='vLLM: variables for the chat template, e.g. {"enable_thinking": false}; '
        "passed as they are (a template reads what it reads).",
    )


# -- responses --------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


WEIGHT_VERSIONS = (
    "[first_token_index, weight_version] pairs: which weights sampled which of the choice's "
    "tokens (more than one pair when its request spanned a weight update)"
)
WEIGHT_VERSION = "streamed: the weight version that sampled this chunk's tokens"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    weight_versions: list[tuple[int, int]] | None = Field(default=None, description=WEIGHT_VERSIONS)
    weight_version: int | None = Field(default=None, description=WEIGHT_VERSION)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


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
    weight_versions: list[tuple[int, int]] = Field(
        default_factory=list, description=WEIGHT_VERSIONS
    )


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
    weight_version: int | None = Field(default=None, description=WEIGHT_VERSION)


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
    kept_kv: Literal["recompute", "reuse"] = Field(
        "recompute", description="Kept requests: recompute their KV, or reuse the old one."
    )
