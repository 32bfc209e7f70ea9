"""``create_app``: the FastAPI app for one Engine, with ``/health`` and ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Security
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from .. import __version__
from ..engine.client import EngineClient
from .admin_routes import ADMIN_PATHS, admin_router
from .config import ServerConfig
from .context import ServerContext
from .errors import install_error_handlers
from .middleware import AuthMiddleware, BodyLimitMiddleware
from .openai_routes import ERRORS, openai_router
from .protocol import ChatCompletionRequest, CompletionRequest, HealthResponse
from .tokenize_routes import OPEN_PATHS, tokenize_router
from .weight_routes import PREFIX as WEIGHTS_PREFIX
from .weight_routes import is_part_path, weight_router
from .weight_uploads import WeightUploads

DESCRIPTION = """\
An OpenAI-compatible server for one tgengine Engine. Every error body is
`{"error": {"message", "type", "param", "code"}}`. With an API key, every route but
`/health`, `/metrics`, `/version`, `/tokenize` and `/detokenize` needs
`Authorization: Bearer <key>`; the management routes exist only with an admin key and
accept only that key.
"""


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (which must be started before requests arrive).

    ``app.state.uploads.run()`` must run beside it for weight updates over HTTP to open
    (``Server.run`` runs it).
    """
    config = config or ServerConfig()
    ctx = ServerContext.build(engine, config)
    app = FastAPI(title="tgengine", version=__version__, description=DESCRIPTION)
    app.state.ctx = ctx
    app.state.uploads = uploads = WeightUploads(engine, config.weight_update_timeout)
    install_error_handlers(app, config.retry_after_seconds)
    api_security = [Security(HTTPBearer(auto_error=False, scheme_name="api_key"))]
    admin_security = [Security(HTTPBearer(auto_error=False, scheme_name="admin_key"))]
    api_deps = api_security if config.api_key else []
    app.include_router(openai_router(ctx), dependencies=api_deps)
    app.include_router(status_router(ctx, protect_metrics=config.protect_metrics))
    app.include_router(tokenize_router(ctx))
    if config.admin_key:
        app.include_router(admin_router(ctx), dependencies=admin_security)
        app.include_router(weight_router(ctx, uploads), dependencies=admin_security)
    app.openapi = _accurate_openapi(app)  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, streamed=is_part_path)
    app.add_middleware(
        AuthMiddleware,
        api_key=config.api_key,
        admin_key=config.admin_key,
        admin_paths=ADMIN_PATHS,
        admin_prefixes=(WEIGHTS_PREFIX,),
        open_paths=[p for p in OPEN_PATHS if p != "/metrics" or not config.protect_metrics]
        + _schema_paths(app),
    )
    return app


def _schema_paths(app: FastAPI) -> list[str]:
    """The schema and its UIs: open, as vLLM leaves them (they describe, they do not serve)."""
    paths = [app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url]
    return [path for path in paths if path]


def _accurate_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI's schema, less what this server never answers: 422 (invalid input is a
    400 here) everywhere, and 401 where no key is required; integer bounds exact."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
                    if not operation.get("security"):
                        operation["responses"].pop("401", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            _exact_integer_bounds(components)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_integer_bounds(components: dict[str, Any]) -> None:
    """FastAPI's OpenAPI models hold bounds as floats, so ``seed``'s maximum 2**63 - 1
    came out as 9.223372036854776e18 (not even the same number). Put back pydantic's exact
    ints, walking each request model's own schema beside FastAPI's."""
    for model in (CompletionRequest, ChatCompletionRequest):
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in {model.__name__: own, **own.pop("$defs", {})}.items():
            if name in components:
                _copy_int_bounds(definition, components[name])


def _copy_int_bounds(source: Any, target: Any) -> None:
    if isinstance(source, dict) and isinstance(target, dict):
        for key, value in source.items():
            if key in BOUNDS and isinstance(value, int) and not isinstance(value, bool):
                if key in target:
                    target[key] = value
            elif key in target:
                _copy_int_bounds(value, target[key])
    elif isinstance(source, list) and isinstance(target, list) and len(source) == len(target):
        for a, b in zip(source, target, strict=True):
            _copy_int_bounds(a, b)


def status_router(ctx: ServerContext, *, protect_metrics: bool) -> APIRouter:
    router = APIRouter(tags=["status"])
    api_key = ctx.config.api_key is not None

    @router.get(
        "/health",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "Stopping, dead, or stalled."}},
    )
    async def health() -> JSONResponse:
        """200 while serving and making progress (asleep or paused counts as alive)."""
        report = ctx.health.check()
        status = 200 if report.status == "ok" else 503
        return JSONResponse(report.model_dump(), status_code=status)

    metrics_security = [Security(HTTPBearer(auto_error=False, scheme_name="api_key"))]
    protected = protect_metrics and api_key

    @router.get(
        "/metrics",
        response_class=Response,
        dependencies=metrics_security if protected else [],
        responses={
            200: {
                "description": "Prometheus text exposition format.",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            },
            **({401: ERRORS[401]} if protected else {}),
        },
    )
    async def metrics() -> Response:
        """Prometheus metrics, named like vLLM's with the ``tgengine:`` prefix."""
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
