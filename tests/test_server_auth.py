"""API and admin keys: 401 on every route without the key but the open ones (as in vLLM:
health, metrics, version, tokenize, detokenize); management takes only the admin key."""

from __future__ import annotations

from pathlib import Path

import anyio
import openai
import pytest

from server_helpers import (
    ADMIN_KEY,
    API_KEY,
    MODEL,
    TIMEOUT,
    assert_error_body,
    completion_body,
    running_server,
)
from tgengine.server.admin_routes import ADMIN_PATHS
from tgengine.server.tokenize_routes import OPEN_PATHS

pytestmark = pytest.mark.anyio

EXTRA_ROUTES = [("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no/such/route")]
SCHEMA_PATHS = ("/openapi.json", "/docs", "/redoc")  # open, as in vLLM


async def test_every_route_needs_the_key(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY, admin_key=ADMIN_KEY) as running:
            async with (
                running.client() as anonymous,
                running.client("wrong-key") as wrong,
                running.client(API_KEY) as user,
                running.client(ADMIN_KEY) as admin,
            ):
                schema = (await anonymous.get("/openapi.json")).json()
                routes = [("GET", "/openapi.json")] + [
                    (method.upper(), path.replace("{model}", MODEL))
                    for path, operations in schema["paths"].items()
                    for method in operations
                ]
                assert {path for _, path in routes} >= set(ADMIN_PATHS)
                assert {path for _, path in routes} >= set(OPEN_PATHS)
                for method, path in routes + EXTRA_ROUTES:
                    if path in OPEN_PATHS or path in SCHEMA_PATHS:
                        for client in (anonymous, wrong):
                            response = await client.request(method, path)
                            assert response.status_code != 401, (path, response.text)
                            if path in SCHEMA_PATHS:
                                assert response.status_code == 200, (path, response.text)
                        continue
                    for client in (anonymous, wrong):
                        response = await client.request(method, path)
                        error = assert_error_body(response, 401)
                        assert error["code"] == "invalid_api_key"
                        assert response.headers["WWW-Authenticate"] == "Bearer"
                    if path in ADMIN_PATHS:  # the API key does not open management routes
                        assert_error_body(await user.request(method, path), 401)

                assert (await user.get("/v1/models")).status_code == 200
                assert (await anonymous.get("/health")).status_code == 200
                assert (await anonymous.get("/metrics")).status_code == 200
                assert (await anonymous.get("/version")).status_code == 200
                counted = await anonymous.post("/tokenize", json={"prompt": "Hello"})
                tokens = counted.json()["tokens"]
                assert counted.json()["count"] == len(tokens) > 0
                text = await anonymous.post("/detokenize", json={"tokens": tokens})
                assert "Hello" in text.json()["prompt"]
                assert (await admin.get("/v1/models")).status_code == 200
                assert (await admin.get("/is_sleeping")).json() == {"is_sleeping": False}
                assert (await admin.post("/resume")).status_code == 200
                posted = await user.post("/v1/completions", json=completion_body())
                assert posted.status_code == 200

                async with openai.AsyncOpenAI(
                    base_url=f"{running.url}/v1", api_key="wrong-key", max_retries=0
                ) as client:
                    with pytest.raises(openai.AuthenticationError):
                        await client.models.list()


async def test_protect_metrics_needs_the_key_on_metrics(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY, protect_metrics=True) as running:
            async with running.client() as anonymous, running.client(API_KEY) as user:
                assert_error_body(await anonymous.get("/metrics"), 401)
                assert (await user.get("/metrics")).status_code == 200
                assert (await anonymous.get("/health")).status_code == 200


async def test_management_routes_exist_only_with_an_admin_key(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running_server(tiny_llama_dir, api_key=API_KEY) as running:
            async with running.client(API_KEY) as user:
                for path in ADMIN_PATHS:
                    assert_error_body(await user.post(path), 404)
                    assert_error_body(await user.get(path), 404)
                schema = (await user.get("/openapi.json")).json()
        assert not set(schema["paths"]) & set(ADMIN_PATHS)

        async with running_server(tiny_llama_dir, admin_key=ADMIN_KEY) as running:
            async with running.client() as anonymous, running.client(ADMIN_KEY) as admin:
                assert (await anonymous.post("/v1/completions", json=completion_body())).is_success
                assert_error_body(await anonymous.post("/sleep"), 401)
                assert (await admin.get("/is_sleeping")).status_code == 200
