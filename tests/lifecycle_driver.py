"""Drives one engine from a test thread: a blocking portal runs the engine and the consumers.

Every call into the engine, and every look at its internals, runs in the portal's event
loop as one call, so what the machine sees is a consistent snapshot between two awaits.

The engine is one of ``KINDS``: ``uni`` (``Engine``, its model in this process), ``mp``
(``Engine`` whose executor runs the model in a worker process) or ``process``
(``ProcessEngine``: the whole engine in a child process). The first two show the machine
their internals (scheduler, tracker, fault injector); the engine process shows only the
public API, so the block and counter checks and the fault rules apply to those two only.
"""

from __future__ import annotations

import dataclasses
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal

from tgengine import EngineConfig, ProcessEngine, SamplingParams
from tgengine.core.block_manager import BlockManager, hash_block
from tgengine.engine.request_stats import RequestStats, StepStats

from fault_injection import FaultInjector, faulty_engine
from lifecycle_model import RequestModel

BOUND = 30.0  # seconds: any single call, and the final drain, must finish within it
MIN_RSS = 16 << 20  # bytes: a process with torch loaded holds far more
RSS_SLACK = 1 << 20  # bytes: the peak as getrusage and /proc report it, read apart in time
VICTIM_PATIENCE = 8  # steps
DUE = 10.0  # seconds: a request a call ended must have its terminal chunk by then (ms, really)


KINDS = ("uni", "mp", "process")


def mp_executor_exists() -> bool:
    return "executor" in {f.name for f in dataclasses.fields(EngineConfig)}


def make_engine(kind: str, config: EngineConfig, faults: FaultInjector) -> Any:
    if kind == "process":
        return ProcessEngine(config)
    if kind == "mp":
        config = dataclasses.replace(config, executor="mp")  # type: ignore[call-arg]
    return faulty_engine(config, faults)


class EngineDriver:
    """One engine, started in ``portal``; consumers run in a task group the driver owns.

    ``inside``: the machine sees the engine's internals (not so for ``kind="process"``).
    """

    def __init__(
        self, portal: BlockingPortal, config: EngineConfig, number: int, kind: str = "uni"
    ) -> None:
        self.portal = portal
        self.number = number
        self.kind = kind
        self.inside = kind != "process"
        self.faults = FaultInjector(hang_limit=BOUND)
        self.engine = make_engine(kind, config, self.faults)
        self.requests: list[RequestModel] = []
        self.engine_reasons: dict[str, str] = {}
        self.engine_requests: list[Any] = []  # the engine's own Request objects (inside)
        self.prompt_tokens = 0
        self.awake_memory: dict[str, int] = {}  # bytes once resident, the same ever after
        self.step_problems: list[str] = []  # found after a step (inside kinds)
        self.finished_stats: list[RequestStats] = []  # what observers were told
        self.cache_victims: dict[str, int] = {}  # request id: the step it became a victim at
        # request id: (the step its fault is armed for, its computed tokens and preemptions
        # when armed), to see that the fault fired if it ran in that step
        self.armed_victims: dict[str, tuple[int, int, int]] = {}
        self.computed_before: dict[str, int] = {}  # running sequences after the last step
        self.engine.observers.append(self)
        self.run_future, _ = portal.start_task(self.engine.run)
        if self.inside:
            try:
                self.portal.call(self._attach)
            except BaseException:  # fail the test: the engine left running would hang it
                self.run_future.cancel()
                raise

    async def _attach(self) -> None:
        tracker = self.engine._loop.tracker
        assert tracker is not None

        def record(request: Any) -> None:
            self.engine_reasons[request.request_id] = request.finish_reason
            for req in self.requests:
                if req.request_id == request.request_id:
                    req.engine_reason = request.finish_reason

        tracker.finish_hooks.append(record)
        self.engine._loop.step_hooks.append(self._after_step)

    def _after_step(self, stats: StepStats) -> None:
        """The prefix cache's consistency after every step, not only between rules: a
        request can start and end between two rules."""
        scheduler = self.engine._loop.scheduler
        if scheduler is None or len(self.step_problems) > 10:
            return
        bm = scheduler.block_manager
        try:
            bm.check_invariants()
        except RuntimeError as exc:
            self.step_problems.append(f"after step {self.engine._loop.num_steps}: {exc}")
        self.step_problems += prefix_problems(bm, scheduler.running)
        failing = {i for ids in self.faults.cache_not_ready_at.values() for i in ids}
        self.step_problems += window_problems(scheduler, skip=failing)
        self.step_problems += follower_problems(scheduler, self.computed_before)
        self.computed_before = {seq.seq_id: seq.num_computed_tokens for seq in scheduler.running}
        self._arm_cache_victims(scheduler)

    def _arm_cache_victims(self, scheduler: Any) -> None:
        """A victim's cache is not ready in the next step once it runs beside another
        request (whose step must go on undisturbed), or alone after ``VICTIM_PATIENCE``
        steps. A victim that computed tokens in the step its fault was armed for is a
        problem: the fault must fire once the victim reaches that step."""
        running = {seq.seq_id for seq in scheduler.running}
        steps = self.faults.num_steps
        for victim, since in list(self.cache_victims.items()):
            armed = self.armed_victims.pop(victim, None)
            seq = scheduled(scheduler, victim)
            if armed is not None and armed[0] == steps and seq is not None:
                # a victim that computed tokens in its fault's step (not preempted since)
                # ran that step undisturbed: the fault must have ended it instead
                _, computed, preemptions = armed
                if seq.num_preemptions == preemptions and seq.num_computed_tokens > computed:
                    self.step_problems.append(
                        f"step {steps}: {victim} ran despite its injected cache fault"
                    )
            if self.engine._loop.tracker.get(victim) is None:
                del self.cache_victims[victim]  # it ended
            elif victim in running and (len(running) > 1 or steps >= since + VICTIM_PATIENCE):
                self.faults.cache_not_ready_at.setdefault(steps + 1, set()).add(victim)
                if seq is not None:
                    self.armed_victims[victim] = (
                        steps + 1,
                        seq.num_computed_tokens,
                        seq.num_preemptions,
                    )

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

    # -- an EngineObserver ------------------------------------------------------------

    def request_finished(self, stats: RequestStats) -> None:
        self.finished_stats.append(stats)

    def step_finished(self, stats: StepStats) -> None:
        assert stats.num_batched_tokens > 0
        assert stats.num_generation_tokens <= stats.num_batched_tokens  # one per sampled row

    def observer_problems(self) -> list[str]:
        """Observers hear of every ended request once (all its ``n`` sequences ended), with
        times in order (a request with a token was scheduled) and its counts (tokens: over
        its sequences, and its longest's)."""
        problems = []
        for s in self.finished_stats:
            times = [s.arrival_time, s.scheduled_time, s.first_token_time, s.last_token_time]
            known = [t for t in times if t is not None]
            generated = s.num_generation_tokens > 0
            if known != sorted(known) or (s.first_token_time is not None) != generated:
                problems.append(f"request stats out of order: {s}")
            if (s.last_token_time is not None) != generated:
                problems.append(f"request stats: {s}")
            if generated and s.scheduled_time is None:
                problems.append(f"request stats: a token but never scheduled: {s}")
            longest = s.max_num_generation_tokens
            if s.max_num_generation_tokens > s.max_tokens or not (
                longest <= s.num_generation_tokens <= s.n * longest
            ):
                problems.append(f"request stats count more tokens than asked: {s}")
        if not self.inside:
            return problems
        groups: dict[str, list[Any]] = {}
        for r in self.engine_requests:
            groups.setdefault(r.public_id, []).append(r)
        ended = [g for g in groups.values() if all(r.finished for r in g)]
        if len(self.finished_stats) != len(ended):
            problems.append(f"{len(self.finished_stats)} told, {len(ended)} ended")
        told = sorted(
            (s.n, s.num_prompt_tokens, s.num_generation_tokens, s.max_num_generation_tokens)
            for s in self.finished_stats
        )
        want = sorted(
            (
                len(g),
                g[0].seq.num_prompt_tokens,
                sum(r.seq.num_completion_tokens for r in g),
                max(r.seq.num_completion_tokens for r in g),
            )
            for g in ended
        )
        if told != want:
            problems.append(f"observers were told {told}, the ended requests are {want}")
        return problems

    # -- requests -------------------------------------------------------------------

    def live_ids(self) -> set[str]:
        """The requests the engine has not ended (for the engine process: as far as this
        process knows; the end may be on its way)."""
        if not self.inside:
            public = set(self.engine._requests._keys_by_id)
            return {r.request_id for r in self.requests if r.public_id in public and not r.seen_end}
        tracker = self.engine._loop.tracker
        return set(tracker.requests) if tracker is not None else set()

    def admit(
        self,
        tg: anyio.abc.TaskGroup,
        members: list[RequestModel],
        prompt: list[int],
        params: SamplingParams,
    ) -> Exception | None:
        """Submit one request (``members``: the model of each of its ``n`` sequences); on
        admission, start its consumer. Returns the admission error."""

        async def start() -> Exception | None:
            try:
                stream = self.engine.generate(prompt, params, request_id=members[0].public_id)
            except Exception as exc:
                return exc
            done, scope = anyio.Event(), anyio.CancelScope()  # one stream, one consumer
            for req in members:
                req.done, req.scope = done, scope
                req.engine_known = self.inside
                self.requests.append(req)
                if self.inside:
                    self.engine_requests.append(self.engine._loop.tracker.get(req.request_id))
            self.prompt_tokens += len(prompt)
            tg.start_soon(self._consume, members, [stream])
            return None

        result: Exception | None = self.portal.call(start)
        return result

    async def _consume(self, members: list[RequestModel], holder: list[Any]) -> None:
        scope = members[0].scope
        with scope:
            await self._read(members, holder)  # its frame, holding the only reference, is gone
        gone = self._gone(members)
        for req in members:
            req.cancelled = req.cancelled or scope.cancelled_caught
            if req.broke or req.cancelled:
                req.gone_at_once = gone
        members[0].done.set()

    async def _read(self, members: list[RequestModel], holder: list[Any]) -> None:
        stream = holder.pop()
        by_index = {req.index: req for req in members}
        num_chunks = 0
        async for chunk in stream:
            num_chunks += 1
            req = by_index[chunk.index]
            req.chunks.append(chunk)
            if chunk.finish_reason is not None:
                req.seen_end = True
                if not self.inside:
                    req.engine_reason = self.engine_reasons[req.request_id] = chunk.finish_reason
            if chunk.finish_reason is None and num_chunks == req.break_after:
                for other in members:
                    other.broke = True
                    if not other.seen_end:
                        other.may_end("abort")
                break  # dropping the stream must abort the request (all its sequences)

    def _gone(self, members: list[RequestModel]) -> bool:
        """Whether the engine has let go of every sequence of the request."""
        if not self.inside:
            return members[0].public_id not in self.engine._requests._keys_by_id
        tracker, scheduler = self.engine._loop.tracker, self.engine._loop.scheduler
        for req in members:
            if tracker is not None and tracker.get(req.request_id) is not None:
                return False
            if scheduler is not None and scheduled(scheduler, req.request_id) is not None:
                return False
        return True

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
        if not self.inside:
            return 0
        scheduler = self.engine._loop.scheduler
        return len(scheduler.block_manager._hash_to_block) if scheduler is not None else 0

    def blocks_problems(self, kv_cache_resident: bool) -> list[str]:
        """Block accounting, exactly: every reference is a live, running sequence's; and no
        prefix is cached while the KV cache is released."""
        if not self.inside:
            return []
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
        problems += prefix_problems(bm, scheduler.running) + self.step_problems
        stats = self.engine.stats()
        if stats.num_running + stats.num_waiting != len(tracker):
            problems.append(f"running + waiting != admitted: {stats}, {len(tracker)}")
        return problems

    def placement_problems(self, serving: bool, held: set[str]) -> list[str]:
        """Where each live request is: ``serving`` (running or stopping), every one is in the
        scheduler; otherwise the ones the model holds are not (they start on resume)."""
        if not self.inside:
            return []
        scheduler, tracker = self.engine._loop.scheduler, self.engine._loop.tracker
        if scheduler is None or tracker is None:
            return []
        live = set(tracker.requests)
        public = {r.public_id for r in tracker.requests.values()}
        kept = set(tracker.groups) | set(tracker._members)
        if kept - public:  # nothing of an ended request stays behind
            return [f"the tracker still keeps ended requests: {sorted(kept - public, key=str)}"]
        in_queues = {seq.seq_id for seq in [*scheduler.running, *scheduler.waiting]}
        queued = live & in_queues
        if serving and live - queued:
            return [f"serving, yet not scheduled (still held?): {sorted(live - queued)}"]
        if not serving and held & queued:
            return [f"held, yet scheduled before the engine serves: {sorted(held & queued)}"]
        return []

    def stepping_problems(self, can_step: bool) -> list[str]:
        """The engine steps exactly when the model says it may (running or stopping, every
        tag awake): a paused engine must not go on stepping the requests it froze."""
        if not self.inside or self.engine._can_step() == can_step:
            return []
        return [f"the engine may step: {not can_step}; the model: {can_step}"]

    def counter_problems(self) -> list[str]:
        """``stats()`` adds up: finished by reason = requests ended; prompt tokens admitted."""
        if not self.inside:
            return []  # the engine process's counters come in snapshots, a frame behind
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
        seqs = [r.seq for r in self.engine_requests]
        generated = sum(seq.num_completion_tokens for seq in seqs)
        if stats.generation_tokens_total != generated:
            problems.append(
                f"generation_tokens_total {stats.generation_tokens_total} != {generated}"
            )
        preempted = sum(seq.num_preemptions for seq in seqs)
        # exactly, a step in flight included (the loop counts at schedule() time; a step
        # cancelled by a stop preempted all the same)
        if stats.num_preemptions_total != preempted:
            problems.append(f"num_preemptions_total {stats.num_preemptions_total} != {preempted}")
        if self.faults.num_steps - stats.num_steps not in (0, 1):  # one may be in flight
            problems.append(f"num_steps {stats.num_steps}, forward steps {self.faults.num_steps}")
        if (stats.last_step_time is None) != (stats.num_steps == 0):
            problems.append(f"last_step_time {stats.last_step_time} after {stats.num_steps} steps")
        scheduler = self.engine._loop.scheduler
        if scheduler is not None:
            bm = scheduler.block_manager
            blocks = (stats.num_free_blocks, stats.num_total_blocks, stats.kv_cache_usage)
            if blocks != (bm.num_free_blocks, bm.num_blocks, bm.num_used_blocks / bm.num_blocks):
                problems.append(f"block stats {blocks} != the block manager's")
            prefix = (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total)
            if prefix != (bm.num_queried_tokens, bm.num_hit_tokens):
                problems.append(f"prefix cache stats {prefix} != the block manager's")
            if (stats.num_running, stats.num_waiting - len(self.engine._loop.tracker.held)) != (
                len(scheduler.running),
                len(scheduler.waiting),
            ):
                problems.append(f"running/waiting {stats} != the scheduler's")
        return problems

    def memory_problems(self, weights: bool, kv_cache: bool, host: bool) -> list[str]:
        """Bytes held exactly when the model says so, and then always the same amount; the
        process's resident memory in bytes, its peak at least its current figure (``uni``:
        this very process, whose peak is the kernel's high-water mark, ``VmHWM``)."""
        problems = []
        peak_before = proc_status_bytes("VmHWM")
        memory = self.engine.memory_stats()
        peak_after, rss_now = proc_status_bytes("VmHWM"), proc_status_bytes("VmRSS")
        for stats in memory.values():
            rss, peak = stats.rss_bytes, stats.peak_rss_bytes
            if not MIN_RSS <= rss <= peak:
                problems.append(f"resident memory {rss} bytes, peak {peak}")
            if self.kind == "uni" and not (
                peak_before - RSS_SLACK <= peak <= peak_after + RSS_SLACK
                and rss <= peak_after + RSS_SLACK
                and rss_now / 2 <= rss <= 2 * rss_now
            ):
                problems.append(
                    f"resident memory {rss}, peak {peak} bytes; this process: {rss_now}, "
                    f"peak {peak_before}..{peak_after}"
                )
            if not stats.device.startswith("cuda") and stats.allocator != {}:
                # docs/lifecycle.md: allocator figures on CUDA only; elsewhere none (a dict)
                problems.append(f"{stats.device}: allocator figures {stats.allocator!r}")
            held = {
                "weights": (weights, stats.weights_bytes),
                "kv_cache": (kv_cache, stats.kv_cache_bytes),
                "host": (host, stats.host_weights_bytes),
            }
            for name, (want, got) in held.items():
                if not want:
                    if got != 0:  # none held: 0 bytes, an int (not None)
                        problems.append(f"{name}: {got!r} bytes held, none expected")
                    continue
                first = self.awake_memory.setdefault(name, got)
                if not got or got != first:
                    problems.append(f"{name}: {got} bytes held, {first} expected")
        return problems


def proc_status_bytes(field: str) -> int:
    """A figure of /proc/self/status (kB there) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def prefix_problems(bm: Any, running: list[Any]) -> list[str]:
    """A cached prefix names its block's content: the hash is the hash of the block's tokens
    and parent, and every running sequence that holds the block has those tokens there."""
    problems = []
    size = bm.block_size
    for block in bm.blocks:
        if block.block_hash is None:
            continue
        if hash_block(block.parent_hash, block.token_ids) != block.block_hash:
            problems.append(f"block {block.block_id}: its hash is not its tokens'")
    problems += [f"cached prefix not hit: {p}" for p in unreachable_prefixes(bm)]
    for seq in running:
        parent = None
        for i, block_hash in enumerate(seq.block_hashes):  # the chain of its full blocks
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            if block_hash != hash_block(parent, tokens):
                problems.append(f"{seq.seq_id}: block #{i}'s hash is not its prefix's")
            parent = block_hash
        first = seq.num_released_blocks  # blocks a sliding window let go of
        for i, block_id in enumerate(seq.block_table, start=first):
            block = bm.blocks[block_id]
            if block.block_hash is None:
                continue
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            parent = seq.block_hashes[i - 1] if 0 < i <= len(seq.block_hashes) else None
            if tokens != block.token_ids or (i > 0 and parent != block.parent_hash):
                problems.append(
                    f"{seq.seq_id} holds block {block_id} (its #{i}) whose cached prefix "
                    f"{block.token_ids} is not its content {tokens}"
                )
    return problems


def window_problems(scheduler: Any, skip: set[str]) -> list[str]:
    """With a sliding window, right after a step every running sequence has given back
    exactly the blocks behind its window: those whose keys no later query of it reads
    (keys at or before ``num_computed_tokens - window``). ``skip``: sequences whose step
    may have failed (their KV was not computed, so nothing moved)."""
    window = scheduler.config.sliding_window
    if window is None:
        return []
    size = scheduler.block_manager.block_size
    problems = []
    for seq in scheduler.running:
        dead = max(0, seq.num_computed_tokens - window + 1) // size
        if seq.seq_id not in skip and seq.num_released_blocks != dead:
            problems.append(
                f"{seq.seq_id}: {seq.num_released_blocks} blocks released, {dead} behind its "
                f"window after {seq.num_computed_tokens} tokens"
            )
    return problems


def follower_problems(scheduler: Any, before: dict[str, int]) -> list[str]:
    """With ``n > 1``, sequence ``{id}#i`` (``i > 0``) is admitted only once ``{id}#0`` has
    computed the prompt or ended, so that it reuses the prompt's cached blocks. ``before``:
    the running sequences' computed tokens after the previous step. A leader admitted in
    this step (again, after a preemption) had computed what its admission found cached
    (``num_cached_tokens``): a prompt cached whole lets the follower come with it. A
    sequence admitted in this step whose unfinished leader had not computed the prompt
    then came too early."""
    problems = []
    for seq in scheduler.running:
        base, sep, index = seq.seq_id.rpartition("#")
        if not sep or index == "0" or seq.seq_id in before:
            continue
        leader = scheduled(scheduler, f"{base}#0")
        if leader is None or leader.is_finished:
            continue
        if leader.seq_id in before:
            computed = before[leader.seq_id]
        else:
            computed = leader.num_cached_tokens if leader in scheduler.running else 0
        if computed < min(leader.num_prompt_tokens, seq.num_prompt_tokens):
            problems.append(f"{seq.seq_id} was admitted before its leader computed the prompt")
    return problems


def scheduled(scheduler: Any, seq_id: str) -> Any:
    """The sequence ``seq_id`` if the scheduler holds it (running or waiting), else None."""
    for seq in [*scheduler.running, *scheduler.waiting]:
        if seq.seq_id == seq_id:
            return seq
    return None


def unreachable_prefixes(bm: Any) -> list[tuple[int, ...]]:
    """Cached prefixes (every block of the chain cached) that a new prompt would not hit."""
    by_hash = {h: bm.blocks[b] for h, b in bm._hash_to_block.items()}
    missed = []
    for block in by_hash.values():
        chain = [block]
        while chain[-1].parent_hash is not None and chain[-1].parent_hash in by_hash:
            parent = by_hash[chain[-1].parent_hash]
            if parent in chain:  # the hashes loop: no prompt leads there
                missed.append(tuple(t for b in chain for t in b.token_ids))
                break
            chain.append(parent)
        if chain[-1].parent_hash is not None:
            continue  # its parent was evicted: a prompt cannot reach it
        tokens = tuple(t for b in reversed(chain) for t in b.token_ids)
        prompt = types.SimpleNamespace(
            token_ids=[*tokens, 0], num_tokens=len(tokens) + 1, reuse_cached_prefix=True
        )
        if len(bm._find_hits(prompt)) != len(chain):
            missed.append(tokens)
    return missed


def checker_problems() -> list[str]:
    """``BlockManager.check_invariants``, which the machine runs after every rule and step,
    reports each kind of breakage with its message (a check that cannot fail is no check)."""

    def ref(bm: BlockManager) -> None:
        bm.blocks[0].ref_count = -1

    def unfree(bm: BlockManager) -> None:
        del bm._free[1]

    def unregistered(bm: BlockManager) -> None:
        bm.blocks[2].block_hash = 7

    def stray(bm: BlockManager) -> None:
        bm._hash_to_block[9] = 3

    breakages = {
        "block 0: ref -1, free True": ref,
        "block 1: ref 0, free False; free + used != total": unfree,
        "block 2: hash not registered to it": unregistered,
        "hash table points to block 3 with another hash": stray,
    }
    problems = []
    for want, breakage in breakages.items():
        bm = BlockManager(4, 4)
        bm.check_invariants()
        breakage(bm)
        try:
            bm.check_invariants()
        except RuntimeError as exc:
            if str(exc) != f"block manager invariants broken: {want}":
                problems.append(f"{breakage.__name__}: {exc}")
            continue
        problems.append(f"{breakage.__name__}: not reported")
    return problems


def read_dir_weights(model_dir: Path) -> list[tuple[str, Any]]:
    from tgengine.models import iter_safetensors

    return list(iter_safetensors(model_dir))
