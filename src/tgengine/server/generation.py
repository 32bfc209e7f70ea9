"""Running one generation for an HTTP request: raced against the client's disconnect.

The response is an ASGI callable that runs the generation and a disconnect watcher in
one task group; the first to finish cancels the other. Cancelling the generation leaves the
request's stream, which aborts the request and frees its KV blocks at once — also while
the request still waits in the queue for its first token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..engine.client import EngineClient, OutputStream
from ..errors import InvalidRequestError, TGEngineError
from ..outputs import RequestOutput
from ..sampling import SamplingParams
from ..state import EngineState
from .choices import Choice, usage
from .errors import APIError, from_engine_error, unavailable
from .formatting import Formatter
from .merge import merged as _merged
from .metrics import ServerMetrics

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class RacedResponse(Response):
    """Runs ``respond(send)`` and returns as soon as it ends or the client disconnects."""

    def __init__(self, respond: Callable[[Send], Awaitable[None]]) -> None:
        super().__init__()
        self._respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
            await self._respond(send)
            tg.cancel_scope.cancel()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


@dataclass
class Job:
    """One engine request of a response: a prompt and its ``params.n`` choices.

    Its choices are ``first_choice .. first_choice + n - 1``; ``echo`` is the prompt text to
    put before each choice's text, if echoed.
    """

    prompt: list[int]
    params: SamplingParams
    request_id: str
    first_choice: int = 0
    echo: str | None = None

    def choices(self) -> list[Choice]:
        return [Choice(self.first_choice + i, self.prompt, self.echo) for i in range(self.params.n)]


@dataclass
class Generation:
    """One response's generation: one or more engine requests, as the routes prepared them."""

    engine: EngineClient
    jobs: list[Job]
    formatter: Formatter
    metrics: ServerMetrics
    retry_after: int
    include_usage: bool = False
    prompt_param: str = "prompt"  # what the client called the prompt ("messages" for chat)
    constraint_param: str = "structured_outputs"  # where the constraint came from

    def response(self, *, stream: bool) -> Response:
        return RacedResponse(self.stream if stream else self.complete)

    async def stream(self, send: Send) -> None:
        """Server-sent events, one per chunk; the last is ``data: [DONE]``."""
        streams = await self._admit(send)
        if streams is None:
            return
        timer, choices = _Timer(self.metrics), self._choices()
        started = False
        async with _merged(streams) as outputs:  # leaving early (the client left) aborts
            async for job, out in outputs:
                if not started:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                    )
                    for opening in self.formatter.opening(choices):
                        await _send_event(send, opening)
                    started = True
                timer.observe(out)
                choice = choices[job.first_choice + out.index]
                choice.add(out)
                payload = self.formatter.chunk(choice, out)
                if payload is not None:
                    await _send_event(send, payload)
        if self.include_usage:
            await _send_event(send, self.formatter.usage_chunk(usage(choices)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def complete(self, send: Send) -> None:
        """One JSON body once every choice finished."""
        streams = await self._admit(send)
        if streams is None:
            return
        timer, choices = _Timer(self.metrics), self._choices()
        async with _merged(streams) as outputs:
            async for job, out in outputs:
                timer.observe(out)
                choices[job.first_choice + out.index].add(out)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            await self._failed(failed.error).send(send)
            return
        body = self.formatter.whole(choices).model_dump_json().encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _choices(self) -> list[Choice]:
        return [choice for job in self.jobs for choice in job.choices()]

    async def _admit(self, send: Send) -> list[tuple[Job, OutputStream]] | None:
        """Each job's stream, or None once an admission error has been answered.

        All or nothing: when one job is refused, the ones admitted before it are aborted.
        """
        streams: list[tuple[Job, OutputStream]] = []
        try:
            for job in self.jobs:  # compiles constraints off the loop, before admitting any
                await self.engine.prepare_structured_outputs(job.params)
            for job in self.jobs:
                stream = self.engine.generate(job.prompt, job.params, request_id=job.request_id)
                streams.append((job, stream))
        except TGEngineError as exc:
            for _, admitted in streams:
                await admitted.aclose()
            await self._admission_error(exc).send(send)
            return None
        return streams

    def _admission_error(self, exc: TGEngineError) -> APIError:
        error = from_engine_error(exc, self.retry_after)
        if isinstance(exc, InvalidRequestError):
            if exc.field == "prompt":
                error.param = self.prompt_param
            elif exc.field == "structured_outputs":
                error.param = self.constraint_param
            return error
        if error.status != 503:  # e.g. not started yet: unavailable all the same
            error = unavailable(str(exc), "engine_unavailable", self.retry_after)
        return error

    def _failed(self, reason: str | None) -> APIError:
        message = reason or "the request failed inside the engine"
        if self.engine.state in (EngineState.DEAD, EngineState.STOPPING, EngineState.STOPPED):
            return unavailable(message, "engine_dead", self.retry_after)
        return APIError(500, message, type="server_error", code="request_failed")


async def _send_event(send: Send, payload: BaseModel) -> None:
    await send({"type": "http.response.body", "body": sse_event(payload), "more_body": True})


# JSON leaves these unescaped, but Python's str.splitlines (and so httpx's aiter_lines)
# breaks lines at them: escaped, an event stays on one line for every client.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse_event(payload: BaseModel) -> bytes:
    """One server-sent event carrying ``payload`` as JSON on a single line."""
    text = payload.model_dump_json().translate(_LINE_BREAKS_JSON_KEEPS)
    return b"data: " + text.encode() + b"\n\n"


class _Timer:
    """Observes time to first token, inter-token latency and end-to-end latency."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = anyio.current_time()
        self.last_token: float | None = None

    def observe(self, out: RequestOutput) -> None:
        now = anyio.current_time()
        if out.token_ids:
            if self.last_token is None:
                self.metrics.time_to_first_token.observe(now - self.arrival)
            else:
                gap = (now - self.last_token) / len(out.token_ids)
                for _ in out.token_ids:
                    self.metrics.inter_token_latency.observe(gap)
                    self.metrics.time_per_output_token.observe(gap)
            self.last_token = now
        if out.finished:
            self.metrics.e2e_request_latency.observe(now - self.arrival)
