"""Property-based: whatever a client sends, the answer is documented, and never a 5xx.

Hypothesis drives a sync ``httpx`` client in a worker thread against a real server that
runs on the test's backend. Every answer must be a status the served OpenAPI schema lists
for that operation, every 4xx an OpenAI error body, every JSON 2xx a valid instance of the
schema's model; afterwards the server still serves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import (
    ADMIN_KEY,
    MODEL,
    TIMEOUT,
    assert_error_body,
    completion_body,
    running_server,
)
from tgengine.server import protocol

pytestmark = pytest.mark.anyio

MAX_BODY = 16 * 1024
SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
EXTREMES = st.sampled_from(
    [-1, 0, 1, 2, 2**31, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308, 5e-324, 0.5, "",
     "x" * 300, [], {}, [-1], [2**40], [None], ["a", "b"], [[1], [2]], True, None, "NaN"]
)  # fmt: skip
COMPLETION_FIELDS = sorted(protocol.CompletionRequest.model_fields)
CHAT_FIELDS = sorted(protocol.ChatCompletionRequest.model_fields)
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    body = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "extreme", "delete", "unknown"]))
        if action == "set":
            body[draw(st.sampled_from(fields))] = draw(JSON)
        elif action == "extreme":
            body[draw(st.sampled_from(fields))] = draw(EXTREMES)
        elif action == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.text(min_size=1, max_size=8))] = draw(SCALARS)
    return body


def encode(body: object) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity on purpose: not strict JSON


PAYLOADS = st.one_of(
    mutated(completion_body(max_tokens=4), COMPLETION_FIELDS).map(encode),
    mutated(CHAT_BODY, CHAT_FIELDS).map(encode),
    JSON.map(encode),
    st.binary(max_size=64),
    st.integers(1, 30).map(lambda n: encode(completion_body())[:n]),  # truncated JSON
    st.integers(MAX_BODY + 1, 4 * MAX_BODY).map(lambda n: encode(completion_body("a" * n))),
)
ROUTES = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "text/plain", None])


class SchemaChecker:
    """Checks an answer against the OpenAPI schema that the server itself serves."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema

    def check(self, method: str, path: str, response: httpx.Response) -> None:
        status = response.status_code
        assert status < 500, response.text
        operation = self.schema["paths"].get(path, {}).get(method.lower())
        if operation is None:
            assert status in (404, 405), (path, status)
        else:
            documented = operation["responses"]
            assert str(status) in documented, (method, path, status, response.text)
            media = response.headers.get("content-type", "").split(";")[0]
            assert media in documented[str(status)].get("content", {}), (path, status, media)
            if media == "application/json" and status < 400:
                ref = documented[str(status)]["content"][media]["schema"]["$ref"]
                getattr(protocol, ref.rsplit("/", 1)[-1]).model_validate(response.json())
        if status >= 400:
            assert_error_body(response)
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")


def fuzz(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        checker = SchemaChecker(client.get("/openapi.json").json())

        @SETTINGS
        @given(route=ROUTES, payload=PAYLOADS, content_type=CONTENT_TYPES)
        def generation(route: str, payload: bytes, content_type: str | None) -> None:
            headers = {"content-type": content_type} if content_type else {}
            checker.check("POST", route, client.post(route, content=payload, headers=headers))

        @settings(SETTINGS, max_examples=60)
        @given(
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
            path=st.sampled_from(["/v1/models", "/v1/models/x", "/health", "/metrics", "/v2"])
            | st.text(max_size=10).map(lambda s: "/v1/models/" + quote(s, safe="")),
        )
        def other_routes(method: str, path: str) -> None:
            response = client.request(method, path)
            template = "/v1/models/{model}" if path.startswith("/v1/models/") else path
            checker.check(method, template, response)

        generation()
        other_routes()


def fuzz_management(url: str) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        checker = SchemaChecker(client.get("/openapi.json").json())
        values = st.sampled_from(["1", "2", "3", "0", "-1", "abort", "drain", "weights", "x"])
        query = st.dictionaries(st.sampled_from(["level", "mode", "tags"]), values, max_size=2)

        @settings(SETTINGS, max_examples=50)
        @given(
            path=st.sampled_from(["/sleep", "/wakeup", "/pause", "/resume", "/update_weights"]),
            params=query,
            body=st.one_of(st.none(), JSON.map(encode), st.just(b'{"path": "/"}')),
        )
        def management(path: str, params: dict[str, str], body: bytes | None) -> None:
            if path == "/pause" and params.get("mode") != "abort":
                params["mode"] = "abort"  # keep/drain would hold the requests of other examples
            response = client.post(path, params=params, content=body)
            checker.check("POST", path, response)
            if path == "/pause" and response.status_code == 200:
                client.post("/resume")

        management()
        client.post("/wakeup")
        client.post("/resume")


async def test_bad_input_is_a_documented_4xx_never_a_5xx(tiny_llama_dir: Path) -> None:
    with anyio.fail_after(TIMEOUT * 3):
        async with running_server(
            tiny_llama_dir,
            engine_options={"max_model_len": 32},
            max_body_bytes=MAX_BODY,
            admin_key=ADMIN_KEY,
        ) as running:
            await anyio.to_thread.run_sync(fuzz, running.url)
            await anyio.to_thread.run_sync(fuzz_management, running.url)
            async with running.client() as client:
                after = await client.post("/v1/completions", json=completion_body())
            stats = running.engine.stats()
    assert after.status_code == 200
    assert stats.state == "running" and stats.num_running == 0
