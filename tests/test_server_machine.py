"""A hypothesis state machine over the HTTP server: what clients see agrees with the engine model.

The server (the app ``python -m tgengine serve`` runs: ``Server.run`` beside ``Engine.run``)
runs in a blocking portal on asyncio or trio; the machine is an HTTP client in the test
thread. Rules: completions (whole and streamed), a client that disconnects mid-stream, every
management route (valid and invalid calls), ``stop()``, and a drain: ``stop(grace)`` while a
stream runs, as ``serve`` does on SIGTERM, the engine ``stopping`` across the rules that
follow until its client hangs up (the request runs on meanwhile). After every rule, ``/health``
(its status code and every field of its body), ``/is_sleeping`` and ``/metrics`` must agree
with ``lifecycle_model.EngineModel`` and with the engine: state, sleeping tags,
``weight_version``, sleep state, running requests, and finished requests counted by reason.
A load balancer reads ``/health``: 200 only while serving, 503 from ``stopping`` on.

``TGENGINE_HYPOTHESIS_SERVER_EXAMPLES`` (default 4 per backend) gives longer runs.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from server_helpers import ADMIN_KEY, MODEL, assert_error_body, completion_body, running_server
from tgengine import (
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineState,
    EngineStoppedError,
)
from tgengine.engine.request_stats import RequestStats, StepStats

from lifecycle_model import EngineModel

S = EngineState
EXAMPLES = int(os.environ.get("TGENGINE_HYPOTHESIS_SERVER_EXAMPLES", "4"))
BOUND = 30.0
RETRYABLE = {
    EngineSleepingError: "engine_sleeping",
    EnginePausedError: "engine_paused",
    EngineStoppedError: "engine_stopped",
    EngineDeadError: "engine_dead",
}
GONE = (S.STOPPING, S.STOPPED, S.DEAD)
DRAIN_GRACE = 600.0  # longer than any run: a drain ends with its stream, never by the clock
NUM_BLOCKS = 8192  # 32k tokens of KV cache (block size 4): ENDLESS fits, and outlives a run
ENDLESS = 30_000


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text ``text``."""
    for line in text.splitlines():
        if not line.startswith(f"tgengine:{name}"):
            continue
        head, value = line.rsplit(" ", 1)
        found = dict(re.findall(r'(\w+)="([^"]*)"', head))
        if head.split("{")[0] == f"tgengine:{name}" and all(
            found.get(k) == v for k, v in labels.items()
        ):
            return float(value)
    raise AssertionError(f"no sample {name} {labels} in /metrics")


async def wait_for(event: anyio.Event) -> None:
    with anyio.fail_after(BOUND):
        await event.wait()


class FinishedRequests:
    """An ``EngineObserver`` that wakes whoever waits for the next request to finish."""

    def __init__(self) -> None:
        self._waiters: list[anyio.Event] = []

    def request_finished(self, stats: RequestStats) -> None:
        for waiter in self._waiters:
            waiter.set()
        self._waiters.clear()

    def step_finished(self, stats: StepStats) -> None:
        pass

    async def wait_until(self, done: Callable[[], bool]) -> None:
        """Return once ``done()``, checked after each finished request; ``BOUND`` s at most."""
        with anyio.fail_after(BOUND):
            while not done():
                waiter = anyio.Event()
                self._waiters.append(waiter)
                await waiter.wait()  # resumes after the finish, its hooks included


class ServerMachine(RuleBasedStateMachine):
    model_dir: Path
    backend: str

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = start_blocking_portal(self.backend)
        self.portal = self._portal_cm.__enter__()
        self._server_cm = self.portal.wrap_async_context_manager(
            running_server(
                self.model_dir, engine_options={"num_blocks": NUM_BLOCKS}, admin_key=ADMIN_KEY
            )
        )
        self.running = self._server_cm.__enter__()
        self.http = httpx.Client(base_url=self.running.url, timeout=BOUND)
        self.admin = httpx.Client(
            base_url=self.running.url,
            timeout=BOUND,
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        self.model = EngineModel("reject")
        self.finished: Counter[str] = Counter()
        self.finishes = FinishedRequests()
        self.running.engine.observers.append(self.finishes)
        self.draining: tuple[Any, Any] | None = None  # the stream a drain waits for

    # -- clients --------------------------------------------------------------------

    @precondition(lambda self: self.model.state is not S.PAUSED or self.model.pause_mode == "abort")
    @rule(stream=st.booleans(), max_tokens=st.integers(1, 12))
    def complete(self, stream: bool, max_tokens: int) -> None:
        body = completion_body("Hello", max_tokens=max_tokens, ignore_eos=True, stream=stream)
        want = self.model.admission_error()
        if not stream:
            response = self.http.post("/v1/completions", json=body)
            if want is None:
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                assert choice["finish_reason"] == "length", choice
                self.finished["length"] += 1
            else:
                self.expect_unavailable(response, want)
            return
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            if want is not None:
                response.read()
                self.expect_unavailable(response, want)
                return
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines
        assert '"finish_reason":"length"' in lines[-2], lines[-2]
        self.finished["length"] += 1

    def expect_unavailable(self, response: httpx.Response, want: type[Exception]) -> None:
        error = assert_error_body(response, 503)
        assert error["code"] == RETRYABLE[want], error
        assert int(response.headers["Retry-After"]) >= 0

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule()
    def disconnect(self) -> None:
        body = completion_body("Hello", max_tokens=400, ignore_eos=True, stream=True)
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # hang up after the first event
        # the server notices the hang-up, then aborts at once
        self.portal.call(self.finishes.wait_until, lambda: not self.admitted())
        self.finished["abort"] += 1

    def admitted(self) -> int:
        stats = self.running.engine.stats()
        return stats.num_running + stats.num_waiting

    # -- management -----------------------------------------------------------------

    def manage(self, path: str, want: type[Exception] | None, **kwargs: Any) -> None:
        response = self.admin.post(path, **kwargs)
        if want is None:
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["state"] == str(self.model.state), (body, self.model)
            assert body["weight_version"] == self.model.version, (body, self.model)
            assert set(body["sleeping_tags"]) == self.model.sleeping, (body, self.model)
        elif want is ValueError:
            assert_error_body(response, 400)
        elif self.model.state in GONE:
            error = assert_error_body(response, 503)
            assert response.headers["Retry-After"] and error["code"] in (
                "engine_stopped",
                "engine_dead",
            )
        else:
            assert assert_error_body(response, 409)["code"] == "illegal_state"

    @rule(mode=st.sampled_from(["abort", "drain", "keep"]))
    def pause(self, mode: str) -> None:
        self.manage("/pause", self.model.pause(mode), params={"mode": mode})

    @rule()
    def resume(self) -> None:
        self.manage("/resume", self.model.resume())

    @rule(level=st.sampled_from([1, 2]), mode=st.sampled_from(["abort", "drain"]))
    def sleep(self, level: int, mode: str) -> None:
        self.manage("/sleep", self.model.sleep(level, mode), params={"level": level, "mode": mode})

    @rule(tags=st.lists(st.sampled_from(["weights", "kv_cache"]), min_size=1, unique=True))
    def wakeup(self, tags: list[str]) -> None:
        self.manage("/wakeup", self.model.wakeup(tags), params={"tags": tags})

    @rule(valid=st.booleans())
    def update_weights(self, valid: bool) -> None:
        path = str(self.model_dir if valid else self.model_dir / "missing")
        want = self.model.update_weights("A") if valid else ValueError
        self.manage("/update_weights", want, json={"path": path})

    @precondition(lambda self: self.model.alive and self.model.state is not S.STOPPING)
    @rule()
    def stop(self) -> None:
        self.portal.call(self.running.engine.stop)
        self.portal.call(wait_for, self.running.engine_returned)  # run() returns in the portal
        assert self.running.engine.state is S.STOPPED, self.running.engine.state
        self.model.state = S.STOPPED

    @precondition(lambda self: self.model.state is S.RUNNING)
    @rule()
    def drain(self) -> None:
        """SIGTERM to ``serve``: ``stop(grace)`` while a stream runs; the engine is
        ``stopping`` until the stream ends (``end_drain``), whatever rules come between."""
        body = completion_body("Hello", max_tokens=ENDLESS, ignore_eos=True, stream=True)
        context = self.http.stream("POST", "/v1/completions", json=body)
        response = context.__enter__()
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
        self.draining = (context, lines)
        self.portal.call(self.running.engine.stop, DRAIN_GRACE)
        self.model.state = S.STOPPING

    @precondition(lambda self: self.draining is not None)
    @rule(read_first=st.booleans())
    def end_drain(self, read_first: bool) -> None:
        """The drained stream's client hangs up, at once or after reading on (the request
        still streams while the engine stops); its request ends ``abort``, the engine stops."""
        self.close_drained(read_first)
        self.portal.call(wait_for, self.running.engine_returned)
        assert self.running.engine.state is S.STOPPED, self.running.engine.state
        self.model.state = S.STOPPED

    def close_drained(self, read_first: bool) -> None:
        assert self.draining is not None
        (context, lines), self.draining = self.draining, None
        if read_first:
            events = (line for line in lines if line.startswith("data: "))
            more = [json.loads(next(events)[len("data: ") :]) for _ in range(3)]
            assert all(chunk["choices"][0]["finish_reason"] is None for chunk in more), more
        context.__exit__(None, None, None)
        self.portal.call(self.finishes.wait_until, lambda: not self.admitted())
        self.finished["abort"] += 1

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def status_routes_agree_with_the_model(self) -> None:
        model = self.model
        tags = model.sleeping if model.alive else set()
        num_running = 0 if self.draining is None else 1
        assert self.running.engine.state is model.state, (self.running.engine.state, model)
        health = self.http.get("/health")
        serving = model.state in (S.RUNNING, S.PAUSED, S.SLEEPING)
        assert health.status_code == (200 if serving else 503), (model.state, health.text)
        report = health.json()
        assert report == {
            "status": "ok" if serving else "unavailable",
            "state": str(model.state),
            "stalled": False,
            "sleeping_tags": sorted(tags),
            "seconds_since_progress": None,  # measured only while running with work
            "num_running": num_running,
            "num_waiting": 0,
            "weight_version": model.version,
        }, (model, report)
        assert self.admin.get("/is_sleeping").json() == {"is_sleeping": bool(tags)}
        text = self.http.get("/metrics").text
        assert metric(text, "weight_version") == model.version
        _, _, host = model.memory()
        current = "awake" if not tags else ("weights_offloaded" if host else "discard_all")
        for state in ("awake", "weights_offloaded", "discard_all"):
            value = metric(text, "engine_sleep_state", sleep_state=state, model_name=MODEL)
            assert value == (1.0 if state == current else 0.0), (state, current, model)
        for reason in ("stop", "length", "abort", "error"):
            value = metric(text, "request_success_total", finished_reason=reason)
            assert value == self.finished[reason], (reason, value, self.finished)
        assert metric(text, "num_requests_running") == num_running

    def teardown(self) -> None:
        try:
            if self.draining is not None:
                self.close_drained(read_first=False)
            self.http.close()
            self.admin.close()
            self._server_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_server_state_machine(backend: str, long_context_dir: Path) -> None:
    machine = type("Machine", (ServerMachine,), {"model_dir": long_context_dir, "backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            + ([] if os.environ.get("CI") else [Phase.shrink]),
        ),
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_health_is_503_all_through_a_drain(backend: str, long_context_dir: Path) -> None:
    """The path a load balancer depends on, taken every time (the random runs may miss it):
    serving, then draining (requests refused, management refused, the stream running on),
    then stopped; ``/health`` and the rest checked after each step."""
    machine = type(
        "Machine", (ServerMachine,), {"model_dir": long_context_dir, "backend": backend}
    )()
    steps: list[Callable[[], None]] = [
        lambda: machine.complete(stream=False, max_tokens=3),
        machine.drain,
        lambda: machine.complete(stream=True, max_tokens=2),
        lambda: machine.pause("abort"),
        lambda: machine.update_weights(valid=True),
        lambda: machine.end_drain(read_first=True),
        lambda: machine.complete(stream=False, max_tokens=2),
    ]
    try:
        machine.status_routes_agree_with_the_model()
        for step in steps:
            step()
            machine.status_routes_agree_with_the_model()
    finally:
        machine.teardown()
    assert machine.finished == {"length": 1, "abort": 1}
