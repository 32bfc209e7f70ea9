"""vLLM's open utility routes: ``/version``, ``/tokenize`` and ``/detokenize``.

Like ``/health`` and ``/metrics`` they need no API key (as in vLLM), so a client can count
tokens before it sends a request. ``model`` is optional; when given it must be the served
model's name.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from .. import __version__
from ..tokenization.tokenizer import chat_prompt
from .context import ServerContext
from .errors import APIError, invalid, unavailable
from .protocol import ChatMessage, ErrorResponse, StrictModel

OPEN_PATHS = ("/health", "/metrics", "/version", "/tokenize", "/detokenize")


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS (and such).")
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="As on chat.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def tokenize_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(tags=["utility"])
    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse, "description": "Invalid request."},
        404: {"model": ErrorResponse, "description": "Unknown model."},
    }

    @router.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        """The server's version."""
        return VersionResponse(version=__version__)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages under the chat template."""
        tokenizer = _tokenizer(ctx, body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                ids = chat_prompt(
                    tokenizer,
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                    template_kwargs=body.chat_template_kwargs,
                )
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                message = f"messages: cannot apply the chat template: {exc}"
                raise invalid("messages", message) from exc
        else:
            ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids, token_strs=strs
        )

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids."""
        tokenizer = _tokenizer(ctx, body.model)
        vocab = ctx.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise invalid("tokens", f"tokens: {bad[0]} is out of vocabulary (size {vocab})")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    return router


def _tokenizer(ctx: ServerContext, model: str | None) -> Any:
    if model is not None and model != ctx.model_name:
        message = f"model {model!r} does not exist"
        raise APIError(404, message, param="model", code="model_not_found")
    if ctx.engine.tokenizer is None:
        raise unavailable("the engine has not started", "engine_unavailable", ctx.retry_after)
    return ctx.engine.tokenizer
