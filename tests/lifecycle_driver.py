"""Drives one engine from a test thread: a blocking portal runs the engine and the consumers.

Every call into the engine, and every look at its internals, runs in the portal's event
loop as one call, so what the machine sees is a consistent snapshot between two awaits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal

from tgengine import Engine, EngineConfig, SamplingParams
from tgengine._faults import FaultInjector

from lifecycle_model import RequestModel

BOUND = 30.0  # seconds: any single call, and the final drain, must finish within it
DUE = 10.0  # seconds: a request a call ended must have its terminal chunk by then (ms, really)


class EngineDriver:
    """One engine, started in ``portal``; consumers run in a task group the driver owns."""

    def __init__(self, portal: BlockingPortal, config: EngineConfig, number: int) -> None:
        self.portal = portal
        self.number = number
        self.faults = FaultInjector(hang_limit=BOUND)
        self.engine = Engine(config, _faults=self.faults)
        self.run_future, _ = portal.start_task(self.engine.run)
        self.requests: list[RequestModel] = []
        self.engine_reasons: dict[str, str] = {}
        self.prompt_tokens = 0
        self.portal.call(self._attach)

    async def _attach(self) -> None:
        tracker = self.engine._loop.tracker
        assert tracker is not None

        def record(request: Any) -> None:
            self.engine_reasons[request.request_id] = request.finish_reason
            for req in self.requests:
                if req.request_id == request.request_id:
                    req.engine_reason = request.finish_reason

        tracker.finish_hooks.append(record)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``await fn(*args)`` in the loop, bounded; return its result or its exception."""

        async def bounded() -> Any:
            with anyio.fail_after(BOUND):
                try:
                    return await fn(*args)
                except Exception as exc:
                    return exc

        return self.portal.call(bounded)

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the loop thread, between two awaits."""

        async def wrapped() -> Any:
            return fn(*args)

        return self.portal.call(wrapped)

    # -- requests -------------------------------------------------------------------

    def live_ids(self) -> set[str]:
        tracker = self.engine._loop.tracker
        return set(tracker.requests) if tracker is not None else set()

    def admit(
        self, tg: anyio.abc.TaskGroup, req: RequestModel, prompt: list[int], params: SamplingParams
    ) -> Exception | None:
        """Submit ``req``; on admission, start its consumer. Returns the admission error."""

        async def start() -> Exception | None:
            try:
                stream = self.engine.generate(prompt, params, request_id=req.request_id)
            except Exception as exc:
                return exc
            req.done, req.scope = anyio.Event(), anyio.CancelScope()
            self.requests.append(req)
            self.prompt_tokens += len(prompt)
            tg.start_soon(self._consume, req, [stream])
            return None

        result: Exception | None = self.portal.call(start)
        return result

    async def _consume(self, req: RequestModel, holder: list[Any]) -> None:
        with req.scope:
            await self._read(req, holder)  # its frame, holding the only reference, is gone
        if req.scope.cancelled_caught:
            req.cancelled = True
        if req.broke or req.cancelled:
            req.gone_at_once = self._gone(req.request_id)
        req.done.set()

    @staticmethod
    async def _read(req: RequestModel, holder: list[Any]) -> None:
        stream = holder.pop()
        async for chunk in stream:
            req.chunks.append(chunk)
            if chunk.finish_reason is None and len(req.chunks) == req.break_after:
                req.broke = True
                req.may_end("abort")
                break  # dropping the stream must abort the request

    def _gone(self, request_id: str) -> bool:
        tracker, scheduler = self.engine._loop.tracker, self.engine._loop.scheduler
        in_tracker = tracker is not None and tracker.get(request_id) is not None
        return not in_tracker and (scheduler is None or scheduler.get(request_id) is None)

    def cancel_consumer(self, req: RequestModel) -> None:
        self.run_sync(req.scope.cancel)
        self.call(req.done.wait)

    def wait_ended(self, reqs: list[RequestModel]) -> list[str]:
        """Wait (``DUE`` at most) for each consumer; the ids that did not end."""

        async def wait() -> list[str]:
            late = []
            for req in reqs:
                with anyio.move_on_after(DUE):
                    await req.done.wait()
                if not req.done.is_set():
                    late.append(req.request_id)
            return late

        late: list[str] = self.portal.call(wait)
        return late

    # -- snapshots ------------------------------------------------------------------

    def cached_prefixes(self) -> int:
        scheduler = self.engine._loop.scheduler
        return len(scheduler.block_manager._hash_to_block) if scheduler is not None else 0

    def blocks_problems(self, kv_cache_resident: bool) -> list[str]:
        """Block accounting, exactly: every reference is a live, running sequence's; and no
        prefix is cached while the KV cache is released."""
        scheduler, tracker = self.engine._loop.scheduler, self.engine._loop.tracker
        if scheduler is None or tracker is None:
            return []
        bm = scheduler.block_manager
        problems = []
        if not kv_cache_resident and self.cached_prefixes():
            problems.append(f"{self.cached_prefixes()} prefixes cached in a released KV cache")
        try:
            bm.check_invariants()
        except RuntimeError as exc:
            problems.append(str(exc))
        held = Counter(b for seq in scheduler.running for b in seq.block_table)
        for block in bm.blocks:
            if block.ref_count != held[block.block_id]:
                problems.append(
                    f"block {block.block_id}: ref {block.ref_count}, held {held[block.block_id]}"
                )
        if bm.num_free_blocks + sum(b.ref_count > 0 for b in bm.blocks) != bm.num_blocks:
            problems.append("free + referenced != total")
        for seq in scheduler.waiting:
            if seq.block_table:
                problems.append(f"waiting {seq.seq_id} holds blocks {seq.block_table}")
        for seq in [*scheduler.running, *scheduler.waiting]:
            if tracker.get(seq.seq_id) is None:
                problems.append(f"{seq.seq_id} is scheduled but ended")
        stats = self.engine.stats()
        if stats.num_running + stats.num_waiting != len(tracker):
            problems.append(f"running + waiting != admitted: {stats}, {len(tracker)}")
        return problems

    def counter_problems(self) -> list[str]:
        """``stats()`` adds up: finished by reason = requests ended; prompt tokens admitted."""
        stats = self.engine.stats()
        live = self.live_ids()
        mine = {r.request_id for r in self.requests}
        problems = []
        ended = Counter(self.engine_reasons.values())
        if dict(stats.finished_total) != {k: v for k, v in ended.items() if v}:
            problems.append(f"finished_total {stats.finished_total} != ended {dict(ended)}")
        if set(self.engine_reasons) | live != mine or set(self.engine_reasons) & live:
            problems.append(f"ended {set(self.engine_reasons)} + live {live} != started {mine}")
        if stats.prompt_tokens_total != self.prompt_tokens:
            problems.append(
                f"prompt_tokens_total {stats.prompt_tokens_total} != {self.prompt_tokens}"
            )
        return problems


def read_dir_weights(model_dir: Path) -> list[tuple[str, Any]]:
    from tgengine.models import iter_safetensors

    return list(iter_safetensors(model_dir))
