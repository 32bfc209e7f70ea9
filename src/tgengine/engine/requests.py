"""``Request`` and ``RequestTracker``: the registry of admitted requests, and their chunks.

The tracker owns every admitted request's send stream. It is the only place that
ends a request (the terminal chunk sent, the blocks freed, together), so each request
gets exactly one terminal chunk and nothing after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..core.step import PromptLogprobs, StepResult, TokenInfo
from ..outputs import FinishReason, RequestOutput
from ..sampling import SamplingParams
from ..stats import Counters
from ..structured_outputs.matcher import GrammarMatcher
from ..tokenization.detokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Request:
    """One sequence of an admitted request (``n > 1``: one of ``n``, sharing ``group_id``).

    ``prompt_logprobs`` collects the prompt's log probabilities (when asked for) until
    they go out with the first token.
    """

    seq: Sequence
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    send: MemoryObjectSendStream[RequestOutput]
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None
    grammar: GrammarMatcher | None = None  # set when the output is constrained
    group_id: str = ""
    index: int = 0
    prompt_logprobs: list[TokenInfo | None] | None = None
    # the weights its latest token came from (before any: the engine's at admission); its
    # terminal chunk carries it, so a version rises only with a token of the new weights
    weight_version: int = 0

    @property
    def request_id(self) -> str:
        return self.seq.seq_id

    @property
    def public_id(self) -> str:
        """The id the caller knows: the group's for ``n > 1``."""
        return self.group_id or self.seq.seq_id

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log probabilities are asked for and not yet sent."""
        return self.prompt_logprobs is not None and self.first_token_time is None

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        if self.prompt_logprobs is None:
            return
        end = chunk.start + len(chunk.tokens)
        self.prompt_logprobs[chunk.start : end] = chunk.tokens  # a recompute overwrites

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


FinishHook = Callable[[Request], None]


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's ``n`` sequences: ``{request_id}#{i}`` with ``n > 1``, else
    the request's own."""
    return [f"{request_id}#{i}" for i in range(n)] if n > 1 else [request_id]


def new_requests(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    tokenizer: Any,
    send: MemoryObjectSendStream[RequestOutput],
    weight_version: int = 0,
) -> list[Request]:
    """The ``params.n`` sequences of one request, each with its own clone of ``send``.

    With ``n > 1`` sequence ``i`` is ``{request_id}#{i}`` with ``seed + i``, and every
    sequence after the first waits for the first to compute the prompt (``leader``).
    """
    n = params.n
    requests: list[Request] = []
    leader: Sequence | None = None
    for i, seq_id in enumerate(sequence_ids(request_id, n)):
        seq_params = params
        if n > 1:
            seed = None if params.seed is None else (params.seed + i) % 2**63
            seq_params = replace(params, n=1, seed=seed)
        seq = Sequence(
            seq_id,
            list(token_ids),
            leader=leader,
            reuse_cached_prefix=params.prompt_logprobs is None,
        )
        leader = leader or seq
        requests.append(
            Request(
                seq,
                seq_params,
                IncrementalDetokenizer(tokenizer, token_ids, stop=params.stop),
                send.clone(),
                group_id=request_id if n > 1 else "",
                index=i,
                prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(token_ids),
                weight_version=weight_version,
            )
        )
    send.close()
    return requests


class RequestTracker:
    """The one registry of admitted, unfinished requests, by id, and where each one is.

    An admitted request is either *held* (admitted while the engine does not step: it
    waits here until ``release_held``) or in ``scheduler``. ``finish``, or a sampled token
    that ends the request, is its end: the terminal chunk goes out and its sequence leaves
    the scheduler (its blocks freed) at once. ``counters`` totals what it saw.
    """

    def __init__(
        self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[Request]] = {}  # public id -> its unfinished sequences
        self._members: dict[str, list[Request]] = {}  # public id -> all its sequences
        self.held: list[Request] = []  # admitted, not yet in the scheduler
        self.counters = Counters()
        self.group_hooks: list[Callable[[list[Request]], None]] = []  # all sequences ended
        self.finish_hooks: list[FinishHook] = []
        self._finished_ids: list[str] = []

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, requests: list[Request], *, hold: bool) -> None:
        """Admit the sequences of one request: held, or queued in the scheduler."""
        for request in requests:
            self.requests[request.request_id] = request
            self.groups.setdefault(request.public_id, []).append(request)
            self._members.setdefault(request.public_id, []).append(request)
        self.counters.prompt_tokens += requests[0].seq.num_prompt_tokens
        if hold:
            self.held.extend(requests)
        else:
            for request in requests:
                self.scheduler.add(request.seq)

    def release_held(self) -> None:
        """Queue every held request in the scheduler, in admission order."""
        for request in self.held:
            self.scheduler.add(request.seq)
        self.held.clear()

    def take_finished_ids(self) -> list[str]:
        """The ids ended since the last call (their per-request state below can go)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def is_in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def group(self, public_id: str) -> list[Request]:
        """The unfinished sequences of request ``public_id`` (empty if unknown)."""
        return list(self.groups.get(public_id, ()))

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def publish(self, seqs: list[Sequence], result: StepResult, weight_version: int) -> None:
        """Emit each sampled token's chunk (the scheduler appended it), and end requests
        that are done."""
        now = time.monotonic()
        for seq in seqs:
            request = self.requests.get(seq.seq_id)
            if request is None:
                continue  # aborted while the step ran
            error = result.errors.get(seq.seq_id)
            if error is not None:
                self.finish(request, "error", error=error)
                continue
            prompt_logprobs = result.prompt_logprobs.get(seq.seq_id)
            if prompt_logprobs is not None:
                request.add_prompt_logprobs(prompt_logprobs)
            token = result.token_ids.get(seq.seq_id)
            if token is None:
                continue  # a prompt chunk that is not the last
            self._emit_token(request, token, result.logprobs.get(seq.seq_id), weight_version, now)

    def _emit_token(
        self, request: Request, token: int, info: TokenInfo | None, version: int, now: float
    ) -> None:
        seq = request.seq
        self.counters.generation_tokens += 1
        request.weight_version = version
        prompt_logprobs = request.prompt_logprobs if request.first_token_time is None else None
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        text = request.detokenizer.add([token])
        reason = self._finish_reason(request, token)
        if reason is not None and not request.detokenizer.stopped:
            text += request.detokenizer.flush()
        chunk = RequestOutput(
            request_id=request.public_id,
            token_ids=[token],
            text=text,
            logprobs=[info.logprob] if info is not None else None,
            finish_reason=reason,
            weight_version=version,
            num_prompt_tokens=seq.num_prompt_tokens,
            index=request.index,
            top_logprobs=[info.top] if info is not None else None,
            prompt_logprobs=_values(prompt_logprobs),
            prompt_top_logprobs=_tops(prompt_logprobs),
        )
        if reason is None:
            if not self._send(request, chunk):
                self.finish(request, "abort")
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
    ) -> None:
        """End ``request`` with a final chunk carrying no new tokens. Idempotent.

        The chunk carries the request's ``weight_version`` (that of its latest token).
        """
        if request.finished:
            return
        text = request.detokenizer.flush() if reason != "error" else ""
        chunk = RequestOutput(
            request_id=request.public_id,
            text=text,
            finish_reason=reason,
            error=error,
            weight_version=request.weight_version,
            num_prompt_tokens=request.seq.num_prompt_tokens,
            index=request.index,
        )
        self._close(request, chunk)

    def _close(self, request: Request, chunk: RequestOutput) -> None:
        request.finish_reason = chunk.finish_reason
        self.requests.pop(request.request_id, None)
        group = self.groups.get(request.public_id)
        if group is not None and request in group:
            group.remove(request)
            if not group:
                del self.groups[request.public_id]
                members = self._members.pop(request.public_id, [request])
                for group_hook in self.group_hooks:
                    group_hook(members)
        self._send(request, chunk)
        request.send.close()
        if request in self.held:
            self.held.remove(request)
        else:
            self.scheduler.finish(request.seq)  # its blocks are free now
        self._finished_ids.append(request.request_id)
        self.counters.finished[request.finish_reason or "abort"] += 1
        for hook in self.finish_hooks:
            hook(request)

    @staticmethod
    def _send(request: Request, chunk: RequestOutput) -> bool:
        try:
            request.send.send_nowait(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False  # the consumer is gone
        return True


def _values(infos: list[TokenInfo | None] | None) -> list[float | None] | None:
    if infos is None:
        return None
    return [info.logprob if info is not None else None for info in infos]


def _tops(infos: list[TokenInfo | None] | None) -> list[dict[int, float] | None] | None:
    if infos is None:
        return None
    return [info.top if info is not None else None for info in infos]
