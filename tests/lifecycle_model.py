"""The lifecycle machine's model: what the engine's state must be, and how each request must end.

Plain Python, no engine: ``EngineModel`` follows the control calls (DESIGN.md §2, §4) and
``RequestModel`` holds, for one request, every outcome the calls applied while it lived allow.
``check_outcome`` compares what a consumer saw (and what the engine recorded) with that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tgengine import (
    EngineDeadError,
    EnginePausedError,
    EngineSleepingError,
    EngineState,
    EngineStoppedError,
    IllegalStateError,
)

S = EngineState
TAGS = frozenset({"weights", "kv_cache"})
NATURAL = frozenset({"length", "stop"})
# an ended request's error text (lower case) must contain one of its allowed error kinds
CACHE_ERROR = "injected fault: cache not ready"  # the cause, as the faulted rank found it
DEATH_ERROR = "engine died"


def cache_error_text(request_id: str) -> str:
    """The error of ``request_id``'s injected cache fault: it names the request and the cause."""
    return f"kv cache not ready for request {request_id!r}: {CACHE_ERROR}"


def death_error_text(kind: str, engine_kind: str = "uni") -> str:
    """The error every request gets when a step raises (``Boom``) or hangs (a timeout).
    With the ``mp`` executor the ``Boom`` is raised in the rank's process, and the rank's
    ``WorkerFailed`` names it."""
    if kind == "raise" and engine_kind == "mp":
        return f"{DEATH_ERROR}: workerfailed: rank 0 raised boom: injected"
    if kind == "raise":
        return f"{DEATH_ERROR}: boom: injected"
    return f"{DEATH_ERROR}: steptimeouterror: forward step did not return within step_timeout="


@dataclass
class EngineModel:
    """The state one engine must be in, from the calls the machine made."""

    when_asleep: str
    state: EngineState = S.RUNNING
    pause_mode: str | None = None
    resume_to: EngineState = S.RUNNING
    sleeping: set[str] = field(default_factory=set)
    weights: str = "A"  # the weight set resident (or offloaded): "A" on disk, "B" pushed
    host_copy: bool = False  # level-1 sleep keeps the weights in host memory
    # the weight set each weight_version computes with (an update staged while the weights
    # sleep: the set they wake with); a new dict at each change, so a ``replace`` copy's
    # trial update leaves the original's alone
    weight_sets: dict[int, str] = field(default_factory=lambda: {0: "A"})
    # an update while the weights sleep waits for their wakeup; the weight set it holds
    staged: str | None = None

    @property
    def version(self) -> int:
        """The engine's ``weight_version``: one more with each set of weights applied."""
        return max(self.weight_sets)

    def new_version(self, weights: str) -> None:
        self.weight_sets = {**self.weight_sets, self.version + 1: weights}

    @property
    def alive(self) -> bool:
        return self.state not in (S.STOPPED, S.DEAD)

    @property
    def can_step(self) -> bool:
        return self.state in (S.RUNNING, S.STOPPING) and not self.sleeping

    def admission_error(self) -> type[Exception] | None:
        """The error ``generate`` must raise now; None when it must admit."""
        if self.state in (S.STOPPING, S.STOPPED):
            return EngineStoppedError
        if self.state is S.DEAD:
            return EngineDeadError
        if self.state is S.SLEEPING and self.when_asleep == "reject":
            return EngineSleepingError
        if self.state is S.PAUSED and self.pause_mode == "abort":
            return EnginePausedError
        return None

    def admission_text(self) -> str | None:
        """The message of ``admission_error()`` where the model knows it (a death's names
        its cause: not here)."""
        if self.state in (S.STOPPING, S.STOPPED):
            return f"engine is {self.state}; it admits no new requests"
        if self.state is S.SLEEPING and self.when_asleep == "reject":
            tags = ", ".join(sorted(self.sleeping))
            return f"engine is sleeping (not resident: {tags}); call wakeup() first"
        if self.state is S.PAUSED and self.pause_mode == "abort":
            return "engine is paused (mode='abort'); call resume() first"
        return None

    def holds_new_requests(self) -> bool:
        return self.state is not S.RUNNING

    # Each control method returns the error the call must raise (None: it must succeed)
    # and updates the model as the call must update the engine.

    def pause(self, mode: str) -> type[Exception] | None:
        if self.state is S.SLEEPING:
            return None
        if self.state not in (S.RUNNING, S.PAUSED):
            return IllegalStateError
        self._enter_pause(mode)
        return None

    def _enter_pause(self, mode: str) -> None:
        if self.state is S.RUNNING or mode == "abort":
            self.pause_mode = mode
        self.state = S.PAUSED

    def resume(self) -> type[Exception] | None:
        if self.state is S.RUNNING:
            return None
        if self.state is not S.PAUSED:
            return IllegalStateError
        self.state, self.pause_mode = S.RUNNING, None
        return None

    def sleep(self, level: int, mode: str) -> type[Exception] | None:
        if self.state in (S.RUNNING, S.PAUSED):
            self.resume_to = self.state
            self._enter_pause(mode)
        elif self.state is not S.SLEEPING:
            return IllegalStateError
        if "weights" not in self.sleeping:
            self.host_copy = level == 1
        elif level == 2:
            self.host_copy = False
        self.sleeping = set(TAGS)
        self.state = S.SLEEPING
        return None

    def wakeup(self, tags: list[str]) -> type[Exception] | None:
        if self.state in (S.RUNNING, S.PAUSED):
            return None
        if self.state is not S.SLEEPING:
            return IllegalStateError
        if "weights" in tags and "weights" in self.sleeping:
            if self.staged is not None:  # a whole set: nothing is read from disk
                self.weights, self.staged = self.staged, None
            elif not self.host_copy:
                self.weights = "A"  # reloaded from disk
                self.new_version("A")
        if "weights" in tags:
            self.host_copy = False
        self.sleeping -= set(tags)
        if not self.sleeping:
            self.state = self.resume_to
            if self.state is S.RUNNING:
                self.pause_mode = None
        return None

    def update_weights(
        self, weights: str | None, kept_kv: str = "recompute"
    ) -> type[Exception] | None:
        """``weights=None``: an invalid set, refused whole."""
        if self.state not in (S.RUNNING, S.PAUSED, S.SLEEPING):
            return IllegalStateError
        asleep = "weights" in self.sleeping
        if weights is None or (kept_kv == "reuse" and self.state is S.SLEEPING):
            return ValueError  # InvalidRequestError
        if asleep:
            self.staged = weights
        else:
            self.weights = weights
        self.new_version(weights)
        return None

    def memory(self) -> tuple[bool, bool, bool]:
        """Whether weights, KV cache and a host copy of the weights must hold bytes now."""
        if not self.alive:
            return False, False, False
        weights = "weights" not in self.sleeping
        return weights, "kv_cache" not in self.sleeping, not weights and self.host_copy


@dataclass(eq=False)
class RequestModel:
    """One request the machine started, and every way it may still end."""

    request_id: str
    engine_no: int
    prompt: int
    max_tokens: int  # the tokens a "length" end has (fewer than asked where the context ends)
    stop_token: int | None
    weights: str | None  # the weight set its tokens come from; None once they changed under it
    break_after: int | None
    held: bool
    constraint: str | None = None  # structured outputs: a kind of structured_helpers.CASES
    eos_ids: frozenset[int] = frozenset()  # the tokens that end a constrained request
    logprobs: bool = False  # it asked for log probabilities, of its tokens and its prompt
    stop_text: str | None = None  # a stop string (then no stop token)
    stop_end: int | None = None  # the index of the token that completes ``stop_text``
    public_id: str = ""  # the id it was submitted under ("": request_id; n > 1: "{id}#{index}")
    index: int = 0  # its sequence's index among the request's n
    seed: int | None = None  # sampled (temperature > 0) with this seed (its sequence's: seed + i)
    temperature: float = 0.0
    version: int = 0  # the engine's weight_version when it was admitted: no chunk is older
    seen_end: bool = False  # its consumer has seen its terminal chunk
    allowed: set[str] = field(default_factory=set)
    error_kinds: set[str] = field(default_factory=set)
    must_end: bool = False  # a call ended it: its terminal chunk is due now
    chunks: list[Any] = field(default_factory=list)
    done: Any = None  # anyio.Event, set when the consumer returned
    scope: Any = None  # the consumer's CancelScope
    broke: bool = False
    cancelled: bool = False
    gone_at_once: bool | None = None  # whether the engine had let go when the consumer did
    engine_reason: str | None = None  # what the engine recorded (its finish hook)
    engine_known: bool = True  # False: only what the consumer saw (the engine process)
    checked: bool = False

    def __post_init__(self) -> None:
        self.allowed |= self.natural_reasons()
        self.public_id = self.public_id or self.request_id

    def natural_reasons(self) -> set[str]:
        return {"length", "stop"} if self.stop_ids() or self.stop_text else {"length"}

    def stop_ids(self) -> set[int]:
        """The tokens that end it with "stop" (a constrained request: its EOS, the only
        token a complete grammar allows)."""
        stop = set() if self.stop_token is None else {self.stop_token}
        return stop | set(self.eos_ids) if self.constraint is not None else stop

    @property
    def reference_key(self) -> Any:
        """Its tokens' key in the machine's reference: the prompt, and the constraint or the
        seed and temperature it samples with."""
        if self.temperature > 0:
            assert self.seed is not None  # an unseeded sampled request has no reference
            return (self.prompt, self.seed, self.temperature)
        return self.prompt if self.constraint is None else (self.prompt, self.constraint)

    def may_end(self, reason: str, error_kind: str | None = None, *, now: bool = True) -> None:
        self.allowed.add(reason)
        if error_kind is not None:
            self.error_kinds.add(error_kind)
        self.must_end = self.must_end or now

    def weights_changed(self, new: str) -> None:
        if self.weights is not None and self.weights != new:
            self.weights = None

    def natural_tokens(self, reference: dict[str, dict[Any, list[int] | None]]) -> list[int] | None:
        """The tokens an undisturbed run yields; None when the weights changed under it (or
        the reference has none: a near-tie)."""
        ref = reference[self.weights][self.reference_key] if self.weights is not None else None
        if ref is None:
            return None
        tokens = ref[: self.max_tokens]
        if self.stop_end is not None:  # computed for the weights it was admitted under
            return tokens[: self.stop_end + 1]
        stops = self.stop_ids()
        ends = [i for i, t in enumerate(tokens) if t in stops]
        return tokens[: ends[0] + 1] if ends else tokens

    def stopped(self, tokens: list[int]) -> bool:
        """Whether ``tokens``, its natural ones, end with "stop" (else "length")."""
        if self.stop_end is not None:
            return len(tokens) == self.stop_end + 1
        return bool(tokens) and tokens[-1] in self.stop_ids()


def chunks_before_change(req: RequestModel, weight_sets: dict[int, str]) -> int:
    """How many of ``req``'s first chunks the weights it was admitted with computed: all of
    them, unless an update changed the weights under it (``weight_sets``: the weight set
    each ``weight_version`` computes with)."""
    for i, chunk in enumerate(req.chunks):
        if weight_sets.get(chunk.weight_version, req.weights) != req.weights:
            return i
    return len(req.chunks)


def check_outcome(
    req: RequestModel,
    reference: dict[str, dict[Any, list[int] | None]],
    weight_sets: dict[int, str],
) -> None:
    """Assert that ``req``, which has ended, ended in a way its model allows.
    ``weight_sets``: the weight set each ``weight_version`` computes with (the engine's
    version now is the last). A token the engine computed after an update changed the
    weights may reach a consumer that then left before the machine saw the update end:
    its chunk's version says so, and only the tokens before it are natural."""
    version = max(weight_sets)
    chunks = req.chunks
    tokens = [t for c in chunks for t in c.token_ids]
    reasons = [c.finish_reason for c in chunks]
    natural = req.natural_tokens(reference)
    unchanged = chunks_before_change(req, weight_sets)
    if natural is not None and unchanged < len(chunks):  # changed under it: a natural prefix
        before = [t for c in chunks[:unchanged] for t in c.token_ids]
        assert before == natural[: len(before)], (req.request_id, before, natural)
        natural = None
    where = (
        f"{req.request_id} (allowed {sorted(req.allowed)}, errors {sorted(req.error_kinds)}, "
        f"weights {req.weights}, prompt {req.prompt}, max_tokens {req.max_tokens}, "
        f"stop {req.stop_token} {req.stop_text!r}, constraint {req.constraint}, seed {req.seed}, "
        f"temperature {req.temperature}, tokens {tokens}, "
        f"reasons {reasons}, engine {req.engine_reason})"
    )
    assert all(c.request_id == req.public_id and c.index == req.index for c in chunks), where
    versions = [c.weight_version for c in chunks]
    assert versions == sorted(versions), (where, versions)
    assert all(req.version <= v <= version for v in versions), (where, req.version, versions)
    unseen = req.engine_reason is None and not req.engine_known  # a consumer that left early
    assert req.engine_reason in req.allowed or unseen, (where, req.engine_reason)
    if req.broke or req.cancelled:
        assert req.gone_at_once, f"{where}: the engine still held it after its consumer left"
    ended_first = bool(chunks) and chunks[-1].finish_reason is not None
    if (req.broke or req.cancelled) and not ended_first:  # it left before the end
        assert all(r is None for r in reasons), (where, reasons)
        if natural is not None:
            assert tokens == natural[: len(tokens)], (where, natural)
        return
    assert chunks, f"{where}: no chunk at all"
    last = chunks[-1]
    assert reasons[:-1] == [None] * (len(chunks) - 1), (where, reasons)
    assert all(len(c.token_ids) == 1 for c in chunks[:-1]), where
    assert last.finish_reason == req.engine_reason, (where, last.finish_reason, req.engine_reason)
    if last.finish_reason in NATURAL:
        assert len(last.token_ids) == 1, where
        if natural is not None:
            assert tokens == natural, (where, tokens, natural)
            want = "stop" if req.stopped(natural) else "length"
            assert last.finish_reason == want, (where, last.finish_reason, want)
        elif last.finish_reason == "length":
            assert len(tokens) == req.max_tokens, where
        elif req.stop_text is None:
            assert tokens[-1] in req.stop_ids(), where
        return
    assert last.token_ids == [], (where, last)
    if natural is not None:
        assert len(tokens) < len(natural) and tokens == natural[: len(tokens)], (where, natural)
    if last.finish_reason == "error":
        assert last.text == "", (where, last)  # an error chunk carries nothing but the error
        text = (last.error or "").lower()
        assert any(kind in text for kind in req.error_kinds), (where, last.error)
    else:
        assert last.error is None, where
