"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from ..sampling import SamplingParams
from ..structured_outputs import StructuredOutputsParams
from ..tokenization.tokenizer import RESERVED_TEMPLATE_KWARGS, chat_prompt
from .context import ServerContext
from .errors import APIError, invalid, unavailable
from .formatting import ChatFormatter, CompletionFormatter, Formatter
from .generation import Generation, Job
from .protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from .structured import requested_constraint
from .tool_parsers import pick_parser
from .tools import plan_tools, template_messages

try:
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover - transformers brings jinja2 for chat templates
    TemplateError = ValueError  # type: ignore[misc,assignment]

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    401: {"model": ErrorResponse, "description": "Missing or incorrect API key."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    500: {"model": ErrorResponse, "description": "The request failed inside the engine."},
    503: {
        "model": ErrorResponse,
        "description": "Engine asleep, paused (abort), stopping or dead; see Retry-After.",
    },
}


def _sse(chunk: type) -> dict[int | str, dict[str, Any]]:
    return {
        200: {
            "description": "JSON, or with `stream: true` server-sent events: one "
            f"`data: <{chunk.__name__} JSON>` per chunk, then `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


def openai_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    def model_card() -> ModelCard:
        return ModelCard(
            id=ctx.model_name, created=ctx.created, max_model_len=ctx.engine.max_model_len
        )

    @router.get("/models", response_model=ModelList, responses={401: ERRORS[401]})
    async def list_models() -> ModelList:
        """The one model this server serves."""
        return ModelList(data=[model_card()])

    @router.get(
        "/models/{model:path}",
        response_model=ModelCard,
        responses={k: ERRORS[k] for k in (401, 404)},
    )
    async def retrieve_model(model: str) -> ModelCard:
        """The served model, by name; 404 for any other name."""
        _check_model(ctx, model)
        return model_card()

    @router.post(
        "/completions",
        response_model=CompletionResponse,
        responses={**ERRORS, **_sse(CompletionResponse)},
    )
    async def completions(body: CompletionRequest) -> Response:
        """Complete a prompt, or a batch of prompts (strings or token ids)."""
        tokenizer = _check_common(ctx, body)
        n = body.n or 1
        if body.best_of is not None and body.best_of != n:
            raise invalid("best_of", f"best_of: must equal n ({n}); every sample is returned")
        formatter = CompletionFormatter(ctx.model_name, tokenizer, body.logprobs)
        constraint, constraint_param = requested_constraint(body, closed_objects=_closed(ctx))
        max_tokens = body.max_tokens or 16
        jobs = []
        for i, prompt in enumerate(body.prompts()):
            ids = _encode(tokenizer, prompt) if isinstance(prompt, str) else prompt
            _check_context(ctx, len(ids), max_tokens, "max_tokens")
            echo = None
            if body.echo:
                echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            params = _sampling_params(
                body,
                max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo else None,
                constraint=constraint,
            )
            jobs.append(Job(ids, params, f"{formatter.id}-{i}", first_choice=i * n, echo=echo))
        return _generation(ctx, body, jobs, formatter, constraint_param=constraint_param)

    @router.post(
        "/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERRORS, **_sse(ChatCompletionChunk)},
    )
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        """Answer a conversation, rendered with the tokenizer's chat template."""
        tokenizer = _check_common(ctx, body)
        parser = pick_parser(ctx.config.tool_call_parser, getattr(tokenizer, "chat_template", None))
        plan = plan_tools(body, parser, closed_objects=_closed(ctx))
        constraint, constraint_param = requested_constraint(body, closed_objects=_closed(ctx))
        if plan.constraint is not None:
            if constraint is not None:
                message = (
                    f"tool_choice {body.tool_choice!r} cannot be combined with {constraint_param}"
                )
                raise invalid("tool_choice", message)
            constraint, constraint_param = plan.constraint, "tool_choice"
        messages = template_messages(body.messages)
        kwargs = body.chat_template_kwargs
        reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            message = f"chat_template_kwargs: {', '.join(reserved)} cannot be set here"
            raise invalid("chat_template_kwargs", message)
        try:
            prompt = chat_prompt(tokenizer, messages, plan.tools, template_kwargs=kwargs)
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise invalid("messages", f"messages: cannot apply the chat template: {exc}") from exc
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, ctx.engine.max_model_len - len(prompt))
        else:
            name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            _check_context(ctx, len(prompt), max_tokens, name)
        if body.top_logprobs and not body.logprobs:
            raise invalid("top_logprobs", "top_logprobs: only allowed when logprobs is true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens, logprobs=logprobs, constraint=constraint)
        formatter = ChatFormatter(ctx.model_name, tokenizer, logprobs, plan.output)
        job = Job(prompt, params, formatter.id)
        return _generation(
            ctx,
            body,
            [job],
            formatter,
            prompt_param="messages",
            constraint_param=constraint_param,
        )

    return router


def _closed(ctx: ServerContext) -> bool:
    """Whether JSON schemas forbid the properties they do not name (vLLM's default)."""
    return not ctx.config.allow_additional_properties


def _check_common(ctx: ServerContext, body: SamplingFields) -> Any:
    """The checks both endpoints make first; returns the tokenizer."""
    _check_model(ctx, body.model)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "stream_options: only allowed when stream is true")
    return _tokenizer(ctx)


def _tokenizer(ctx: ServerContext) -> Any:
    if ctx.engine.tokenizer is None:
        raise unavailable("the engine has not started", "engine_unavailable", ctx.retry_after)
    return ctx.engine.tokenizer


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids, as ``Engine.generate`` would encode them."""
    return list(tokenizer.encode(prompt)) if prompt else []


def _check_context(ctx: ServerContext, num_prompt: int, max_tokens: int, param: str) -> None:
    """Refuse, as OpenAI and vLLM do, a prompt and completion that cannot fit the context.

    A prompt that is too long on its own is left to the engine, which names the prompt.
    """
    limit = ctx.engine.max_model_len
    if num_prompt < limit and num_prompt + max_tokens > limit:
        raise invalid(
            param,
            f"{param}: this model's maximum context length is {limit} tokens, but "
            f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion); reduce the prompt or {param}",
        )


def _check_model(ctx: ServerContext, model: str) -> None:
    if model != ctx.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    body: SamplingFields,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    return SamplingParams(  # raises InvalidRequestError (→ 400) naming the field
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=None if body.seed is None else body.seed % 2**63,  # any int64 seed
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=body.n or 1,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=min(body.min_tokens or 0, max_tokens),
        structured_outputs=constraint,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError as exc:
        raise invalid("logit_bias", "logit_bias: keys must be token ids") from exc


def _generation(
    ctx: ServerContext,
    body: SamplingFields,
    jobs: list[Job],
    formatter: Formatter,
    prompt_param: str = "prompt",
    constraint_param: str = "structured_outputs",
) -> Response:
    generation = Generation(
        engine=ctx.engine,
        jobs=jobs,
        formatter=formatter,
        metrics=ctx.metrics,
        retry_after=ctx.config.retry_after_seconds,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        prompt_param=prompt_param,
        constraint_param=constraint_param,
    )
    return generation.response(stream=bool(body.stream))
