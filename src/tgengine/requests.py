"""``Request`` and ``RequestTracker``: turn step results into each request's chunks.

The tracker owns every admitted request's send stream. It is the only place that
ends a request, so each request gets exactly one terminal chunk and nothing after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .detokenizer import IncrementalDetokenizer
from .outputs import FinishReason, RequestOutput
from .sampling import SamplingParams
from .sequence import Sequence
from .step import StepResult
from .structured_outputs.matcher import GrammarMatcher


@dataclass(eq=False)
class Request:
    seq: Sequence
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    send: MemoryObjectSendStream[RequestOutput]
    receive: MemoryObjectReceiveStream[RequestOutput] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None
    grammar: GrammarMatcher | None = None  # set when the output is constrained

    @property
    def request_id(self) -> str:
        return self.seq.seq_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


FinishHook = Callable[[Request], None]


class RequestTracker:
    """The registry of admitted, unfinished requests."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.finish_hooks: list[FinishHook] = []
        self.token_hooks: list[Callable[[Request, float], None]] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def publish(self, seqs: list[Sequence], result: StepResult, weight_version: int) -> None:
        """Append each sampled token, emit its chunk, and end requests that are done."""
        now = time.monotonic()
        for seq in seqs:
            request = self.requests.get(seq.seq_id)
            if request is None:
                continue  # aborted while the step ran
            error = result.errors.get(seq.seq_id)
            if error is not None:
                self.finish(request, "error", error=error, weight_version=weight_version)
                continue
            token = result.token_ids.get(seq.seq_id)
            if token is None:
                continue  # a prompt chunk that is not the last
            self._emit_token(request, token, result.logprobs.get(seq.seq_id), weight_version, now)

    def _emit_token(
        self, request: Request, token: int, logprob: float | None, version: int, now: float
    ) -> None:
        seq = request.seq
        seq.append_token(token)
        for hook in self.token_hooks:
            hook(request, now)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        text = request.detokenizer.add([token])
        reason = self._finish_reason(request, token)
        if reason is not None and not request.detokenizer.stopped:
            text += request.detokenizer.flush()
        chunk = RequestOutput(
            request_id=request.request_id,
            token_ids=[token],
            text=text,
            logprobs=[logprob] if request.params.logprobs and logprob is not None else None,
            finish_reason=reason,
            weight_version=version,
            num_prompt_tokens=seq.num_prompt_tokens,
        )
        if reason is None:
            if not self._send(request, chunk):
                self.finish(request, "abort", weight_version=version)
        else:
            self._close(request, chunk)

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if request.detokenizer.stopped:
            return "stop"
        if request.seq.num_completion_tokens >= params.max_tokens:
            return "length"
        if request.seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        *,
        error: str | None = None,
        weight_version: int = 0,
    ) -> None:
        """End ``request`` with a final chunk carrying no new tokens. Idempotent."""
        if request.finished:
            return
        text = request.detokenizer.flush() if reason != "error" else ""
        chunk = RequestOutput(
            request_id=request.request_id,
            text=text,
            finish_reason=reason,
            error=error,
            weight_version=weight_version,
            num_prompt_tokens=request.seq.num_prompt_tokens,
        )
        self._close(request, chunk)

    def _close(self, request: Request, chunk: RequestOutput) -> None:
        request.finish_reason = chunk.finish_reason
        self.requests.pop(request.request_id, None)
        self._send(request, chunk)
        request.send.close()
        for hook in self.finish_hooks:
            hook(request)

    @staticmethod
    def _send(request: Request, chunk: RequestOutput) -> bool:
        try:
            request.send.send_nowait(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False  # the consumer is gone
        return True
