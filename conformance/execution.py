"""Running programs of engine operations on an adapter and the reference side by side (chapter `conformance`).

A program is a list of `Call`s: the adapter operations `start`, `add_request`, `step`, `complete_transfers`,
`abort`, `preempt`, `reset_prefix_cache`, plus `drain` (complete transfers and step until the engine is
idle, then check for leaks). The state machine draws programs, the shrinker edits them, and a counterexample
is one. `Execution.apply` runs one call and judges every answer with the registered checks, at each spec
level the adapter reports, on the adapter's own schedule: the connector level from what crosses the connector API
(`connector_level.py`), the offloading level against the reference engine stepped alongside, which schedules as
the adapter did (`schedule_of`) and so knows what the connector and the store must do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvconform.adapters.contract import ImplementationFailure, KVConnectorAdapter
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import BlockRef, Capabilities, EngineConfig, RequestSpec, StepObservation, StoreSnapshot
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterCaller, AdapterHung
from kvconform.conformance.checks import ClauseViolation, Context, check_drained, checks_of
from kvconform.conformance.connector_level import ConnectorJudge
from kvconform.reference.connector import KnownDeviations
from kvconform.reference.engine import Engine, FollowedSchedule
from kvconform.reference.errors import InvalidCall
from kvconform.reference.request import RequestStatus

DRAIN_STEP_LIMIT = 64
"""Steps a drain may take, every transfer completed before each, before the requests still unfinished count as stuck
(LIFE-LIVE-1, KVC-LIVE-1): the bound where the harness completes transfers (`Capabilities.harness_completes_transfers`)."""

DEFAULT_DRAIN_TIMEOUT = 10.0
"""Seconds a drain steps a connector on its own clock, as vLLM's engine core steps while requests wait for remote KV,
before what is still unreported, unfinished or held counts as stuck (KVC-ASYNC-1, KVC-LIVE-1, KVC-LEAK-1):
`--drain-timeout`. Ample for a connector's in-process threads; raise it for a connector that waits on a remote store."""

IDLE_STEP_PAUSE = 0.001
"""Seconds a drain on the connector's clock waits after a step that scheduled nothing, leaving its threads the CPU."""

Scheduling = Literal["sync", "async", "both"]
"""Which scheduling modes a run draws: sync only, async only, or both."""


PARAMETERS = {"start": ("config",), "add_request": ("request",), "step": (), "complete_transfers": ("fail_loads", "fail_stores"),
              "abort": ("request_id",), "preempt": ("request_id",), "reset_prefix_cache": ("reset_connector",),
              "drain": ()}
"""The operations of a program and the names of their arguments."""


class Diverged(Exception):
    """A known failure happened: the implementation and the reference have diverged, so the example ends (CONF-RUN-2)."""


class ProgramError(ValueError):
    """A program in JSON that is not one: the message says which operation and why."""


@dataclass(frozen=True)
class Call:
    """One operation of a program, with its positional arguments."""

    operation: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        if self.operation == "drain":
            return "drain()  # complete transfers and step until the reference is idle, then check for leaks"
        return f"adapter.{self.operation}({', '.join(map(repr, self.args))})"

    def to_json(self) -> dict[str, Any]:
        """Return the call as trace vectors write operations: `{"op": ..., "args": {...}}`."""
        if self.operation in ("start", "add_request"):
            args = self.args[0].model_dump(mode="json", exclude_defaults=self.operation == "add_request")
        else:
            args = dict(zip(PARAMETERS[self.operation], self.args))
        return {"op": self.operation, "args": args} if args else {"op": self.operation}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Call:
        """Return the call a `{"op": ..., "args": {...}}` object stands for; raise ProgramError if it stands for none."""
        operation, args = data.get("op"), data.get("args", {})
        if operation not in PARAMETERS or not isinstance(args, dict):
            raise ProgramError(f"{data!r}: 'op' must be one of {', '.join(PARAMETERS)}, 'args' an object")
        try:
            if operation == "start":
                return cls(operation, (EngineConfig(**args),))
            if operation == "add_request":
                return cls(operation, (RequestSpec(**args),))
            return cls(operation, tuple(args[name] for name in PARAMETERS[operation]))
        except (KeyError, TypeError, ValueError) as error:
            raise ProgramError(f"{data!r}: {error}") from None


def render(program: list[Call]) -> str:
    """Return a program as the Python calls it makes, one per line."""
    return "\n".join(map(str, program))


@dataclass
class Session:
    """What the executions of one run share: the options they run under, and the tallies they add up."""

    adapter_factory: Callable[[], KVConnectorAdapter]
    """Builds the adapter under test; there is no default, the caller names it (`kvconform run --adapter reference`
    is the user-facing default)."""
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT
    scheduling: Scheduling = "both"
    baseline: Baseline = field(default_factory=Baseline)
    on_example: Callable[[], None] | None = None
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds a drain waits for a connector on its own clock to go idle (`DEFAULT_DRAIN_TIMEOUT`)."""
    coverage: dict[str, int] = field(default_factory=dict)
    findings: dict[str, str] = field(default_factory=dict)
    """Faults the engine's scheduler masked, by clause (`connector_level.check_masked_answers`): reported, not failed."""
    examples: int = 0
    failing_example: int | None = None
    """The example, counted from 1, in which a clause first failed."""
    rules: int = 0
    steps: int = 0
    steps_after_known_failure: int = 0
    """Steps judged, in all examples, after a known failure of their example was followed (CONF-RUN-2)."""
    adapter_seconds: float = 0.0
    reference_seconds: float = 0.0
    checks_seconds: float = 0.0
    execution_seconds: float = 0.0
    """Time spent building adapters and running programs' calls, engines and checks included (`Execution.executing`):
    the rest of a run is Hypothesis's rule selection, draws and preconditions, and the state machine's own code."""
    last_execution: Execution | None = None
    observed_failure: Replay | None = None
    """The first failing program as it ran, with its violation: the evidence where a replay does not fail again, as
    happens with a connector on its own clock (CONF-RUN-3)."""


class Execution:
    """One fresh adapter and one fresh reference, driven through the same calls and compared after each."""

    def __init__(self, session: Session, coverage: dict[str, int] | None = None) -> None:
        self.session = session
        self.coverage = session.coverage if coverage is None else coverage
        self.caller = AdapterCaller(session.call_timeout)
        self.oracle: ReferenceAdapter | None = None
        """The reference engine stepped alongside, for an adapter judged at the offloading level."""
        self.ctx: Context | None = None
        self.connector_judge: ConnectorJudge | None = None
        self.state: EngineState | None = None
        """Where the engine's requests are: the reference's view when it is stepped alongside (the offloading level),
        else the adapter's own trace as the connector level follows it; set at `start`."""
        self.capabilities = Capabilities()
        self.program: list[Call] = []
        self.failed = False
        self.deviated = False
        """Whether a known deviation of the adapter was followed earlier in this example."""

    # --- the engines -------------------------------------------------------------------------

    def call(self, operation: str, *args: Any) -> Any:
        """Return the adapter's validated answer; a raise, a hang or a bad value fails its clause (`calls.py`).

        An implementation failure of a known-failure clause yields the outcome the adapter reports when the
        implementation recovered; otherwise the example ends there (CONF-RUN-2).
        """
        try:
            return self.caller(operation, *args)
        except ClauseViolation as violation:
            failure = violation.__cause__
            if not isinstance(failure, ImplementationFailure) or not self.session.baseline.tolerates(violation):
                raise
            if not failure.recovered:
                raise Diverged from violation
            return failure.result

    def expect(self, operation: str, *args: Any, **keywords: Any) -> Any:
        """Return the reference's answer to `operation(*args, **keywords)`, timing it apart from the harness."""
        started = time.perf_counter()
        try:
            return getattr(self.oracle, operation)(*args, **keywords)
        finally:
            self.session.reference_seconds += time.perf_counter() - started

    def begin(self) -> Capabilities:
        """Build the adapter and return what it claims to support (CONF-CAP-1)."""
        with self.executing():
            self.caller.build(self.session.adapter_factory)
            self.capabilities = self.call("capabilities")
            if "offloading" in self.capabilities.levels:
                self.oracle = ReferenceAdapter()
        return self.capabilities

    def close(self) -> None:
        with self.executing():
            if self.caller.adapter is not None and not self.caller.hung:
                self.call("close")
        self.session.adapter_seconds += self.caller.seconds

    @contextmanager
    def executing(self) -> Iterator[None]:
        """Count the time of the block as running the program (`Session.execution_seconds`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.session.execution_seconds += time.perf_counter() - started

    # --- what the engine's state allows ----------------------------------------------------------

    @property
    def requests(self) -> dict[str, RequestSpec]:
        """Return the requests added so far, by id."""
        return self.connector_judge.requests if self.connector_judge is not None else {}


    def allows(self, call: Call) -> bool:
        """Return True if the engine's state lets `call` run: its request exists and is in the right state."""
        if call.operation == "start":
            return self.connector_judge is None
        if self.connector_judge is None:
            return False
        if call.operation == "add_request":
            return call.args[0].request_id not in self.requests
        if call.operation == "abort":
            return self.capabilities.abort and call.args[0] in self.state.unfinished()
        if call.operation == "preempt":
            return self.capabilities.preemption and call.args[0] in self.state.running()
        return True

    # --- applying calls ------------------------------------------------------------------------

    def apply(self, call: Call) -> None:
        """Run `call` on the reference and the adapter and judge the answers; raise ClauseViolation on a failure."""
        self.program.append(call)
        try:
            with self.executing():
                getattr(self, f"_{call.operation}")(*call.args)
        except BaseException as error:
            self.failed = True
            if isinstance(error, ClauseViolation) and self.session.failing_example is None:
                self.session.failing_example = self.session.examples
            raise

    def _start(self, config) -> None:
        self.connector_judge = self.state = ConnectorJudge(config, self.coverage, self.session.findings)
        if self.oracle is not None:
            self.expect("start", config)
            self.ctx = Context(config, self.connector_judge.requests, self.oracle.engine, exercised=self.coverage)
            self.state = ReferenceState(self.oracle.engine)
        self.call("start", config)

    def _add_request(self, spec) -> None:
        self.connector_judge.add_request(spec)
        if self.oracle is not None:
            self.expect("add_request", spec)
        self.call("add_request", spec)

    def _step(self) -> None:
        actual = self.call("step")
        self.session.steps += 1
        self.session.steps_after_known_failure += self.deviated
        if self.oracle is not None:  # the deeper level first: its failures name the block and the cause
            self.compare_step(self.follow(actual), actual)
        self.judge("adapter.step()", "connector", actual)
        self.connector_judge.follow(actual)
        if self.capabilities.reads_kv:
            self.judge_resident_kv()

    def _complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        if self.oracle is not None:
            self.expect("complete_transfers", fail_loads, fail_stores)
        self.call("complete_transfers", fail_loads, fail_stores)

    def _abort(self, request_id: str) -> None:
        self.connector_judge.abort(request_id)
        if self.oracle is not None:
            self.expect("abort", request_id)
        self.call("abort", request_id)

    def _preempt(self, request_id: str) -> None:
        self.connector_judge.preempt(request_id)
        if self.oracle is not None:
            self.expect("preempt", request_id)
        self.call("preempt", request_id)

    def _reset_prefix_cache(self, reset_connector: bool) -> None:
        actual = self.call("reset_prefix_cache", reset_connector)
        if self.oracle is None:
            return
        if reset_connector:  # the jobs in flight are discarded: their completions are ignored, not reported (OFF-MGR-8)
            self.ctx.jobs_in_flight.clear()
        self.judge(f"adapter.reset_prefix_cache({reset_connector!r})", "reset",
                   self.expect("reset_prefix_cache", reset_connector), actual)

    def _drain(self) -> None:
        """Step until the engine is idle, then check for leaks and liveness.

        Where the harness completes transfers, it completes every one before each step, for at most `DRAIN_STEP_LIMIT`
        steps. A connector on its own clock finishes its transfers itself: the drain steps the engine as vLLM's engine
        core does while requests wait for remote KV, until it is idle or the session's drain deadline has passed, and
        the verdicts say how long they waited (KVC-ASYNC-1, KVC-LIVE-1, KVC-LEAK-1)."""
        harness_completes = self.capabilities.harness_completes_transfers
        started = time.perf_counter()
        steps = 0

        def waiting() -> bool:
            return steps < DRAIN_STEP_LIMIT if harness_completes else \
                time.perf_counter() - started < self.session.drain_timeout

        def step() -> None:
            nonlocal steps
            if harness_completes:
                self._complete_transfers(False, False)
            self._step()
            steps += 1
            if not harness_completes and not self.connector_judge.trace.in_flight:
                time.sleep(IDLE_STEP_PAUSE)

        while waiting() and self.state.busy():
            step()
        usage = self.call("resource_usage")
        while self.oracle is None and waiting() and any(usage.model_dump().values()):
            # on its own schedule only the adapter knows its pending saves: step until it says it is idle
            step()
            usage = self.call("resource_usage")
        if self.oracle is not None:
            check_drained(self.ctx, self.expect("resource_usage"), steps)  # the reference drains too
            self.judge("adapter.resource_usage()", "drain", usage, steps)
        waited = (f"{steps} drain steps with every transfer completed" if harness_completes else
                  f"{steps} drain steps over {time.perf_counter() - started:.2f} s on the connector's own clock (drain "
                  f"deadline {self.session.drain_timeout:g} s)")
        self.judge("adapter.resource_usage()", "connector-drain", usage, waited)

    # --- judging -----------------------------------------------------------------------------

    def judge(self, call: str, kind: str, *args: Any) -> None:
        """Run the checks of `kind` on the answer of `call`; a known failure is recorded, not raised, and ends the
        example: what would follow is only its consequences (CONF-RUN-2).

        A failure names the call whose answer it judged (CONF-CALL-1).
        """
        started = time.perf_counter()
        subject = self.connector_judge if kind.startswith("connector") else self.ctx
        try:
            for each in checks_of(kind):
                each.function(subject, *args)
        except ClauseViolation as violation:
            violation.detail = f"{call}: {violation.detail}"
            if not self.session.baseline.tolerates(violation):
                raise
            raise Diverged from violation
        finally:
            self.session.checks_seconds += time.perf_counter() - started

    def follow(self, actual: StepObservation) -> StepObservation:
        """Step the reference as the adapter scheduled, taking the adapter's choices where the run knows it deviates,
        and return what the reference observes; each deviation taken is recorded as its known failure (CONF-RUN-2)."""
        self.ctx.followed = schedule_of(actual, [request.request_id for request in self.oracle.engine.running])
        expected = self.expect("step_following", self.ctx.followed,
                               deviations=deviations_of(actual, self.session.baseline.entries, self.ctx.identity))
        for clause, what in self.oracle.engine.adopted:
            violation = ClauseViolation(clause, f"adapter.step(): {what}")
            if not self.session.baseline.tolerates(violation):
                raise violation
            self.deviated = True
        return expected

    def compare_step(self, expected: StepObservation, actual: StepObservation) -> None:
        """Judge a step at the offloading level: the adapter's observation and store against the reference's."""
        self.judge("adapter.step()", "step", expected, actual)
        store, actual_store = self.expect("store_contents"), self.call("store_contents")
        self.judge("adapter.store_contents()", "store", store, actual_store)
        if self.capabilities.reads_stored_kv:
            self.judge_stored_kv(actual, actual_store)
        self.ctx.previous_store = store
        self.ctx.previous_pinned = frozenset(self.oracle.engine.manager.pinned_keys())

    def judge_stored_kv(self, observation: StepObservation, store: StoreSnapshot) -> None:
        """Read the bytes of every block that a store completed in the step made readable, and judge them whether or
        not a load ever reads them (XFER-DATA-3)."""
        readable = self.ctx.identities(store.ready)
        for job in observation.completed_stores:
            for index in job.offload_indices:
                block = BlockRef(request_id=job.request_id, index=index)
                if self.ctx.identity(block) in readable:
                    self.judge(f"adapter.stored_kv({block!r})", "stored-data", block, self.call("stored_kv", block))

    def judge_resident_kv(self) -> None:
        """Read the KV of every request that must hold its computed tokens' KV now, and judge its bytes at each level:
        stepped alongside the reference, against the reference's count of computed tokens (XFER-DATA-1), and against
        the adapter's own (KVC-DATA-1)."""
        for_reference = set(self.state.resident()) if self.oracle is not None else set()
        for_connector = set(self.connector_judge.resident())
        for request_id in sorted(for_reference | for_connector):
            call = f"adapter.computed_kv({request_id!r})"
            kv = self.call("computed_kv", request_id)
            if request_id in for_reference:
                self.judge(call, "data", request_id, kv)
            if request_id in for_connector:
                self.judge(call, "connector-data", request_id, kv)


class EngineState(Protocol):
    """Where the engine's requests are, as the state machine's preconditions and the drain need it."""

    def unfinished(self) -> list[str]: ...
    def loading(self) -> list[str]: ...
    def running(self) -> list[str]: ...
    def storing(self) -> list[str]: ...
    def transfers_pending(self) -> bool: ...
    def resident(self) -> list[str]: ...
    def busy(self) -> bool: ...


DEVIATIONS_FOLLOWED = {"lookups": {"OFF-LOOKUP-1"}, "offers": {"OFF-STORE-1"}, "victims": {"OFF-LRU-1", "OFF-ARC-1"}}
"""Which adapter choices the reference takes in place of its own, and the known failures that make it take them."""


def deviations_of(observation: StepObservation, known: Collection[str],
                  identity: Callable[[BlockRef], bytes]) -> KnownDeviations:
    """Return the adapter's choices in a step that the reference takes where the run lists their clause as a known
    failure (`DEVIATIONS_FOLLOWED`), so that the example goes on past them (CONF-RUN-2)."""
    follows = {choice for choice, clauses in DEVIATIONS_FOLLOWED.items() if clauses & set(known)}
    return KnownDeviations(
        lookups={a.request_id: observation.lookups.get(a.request_id, ()) for a in observation.match_answers}
        if "lookups" in follows else None,
        offers={offer.request_id: offer.offload_indices for offer in observation.store_offers}
        if "offers" in follows else None,
        victims={offer.request_id: tuple(map(identity, offer.evicted)) for offer in observation.store_offers}
        if "victims" in follows else None)


def schedule_of(observation: StepObservation, running: Collection[str]) -> FollowedSchedule:
    """Return the scheduling choices an adapter's step shows, for the reference to follow (SCHED-STEP-2).

    `running` are the requests running when the step began. Waiting requests were considered in the order they
    were asked for matches, or taken up after their load (`promoted`, each placed after the answers given before
    it), scheduled or not; a request scheduled that was neither had been taken up in an earlier step and held its
    blocks since, so it came first (SCHED-ORDER-1). A request asked with an asynchronous load was admitted if the
    step left it with computed tokens or a load job.
    """
    resumed_or_admitted = [request_id for request_id in observation.scheduled_tokens if request_id not in running]
    loading = {load.request_id for load in observation.loads}
    admitted = set(resumed_or_admitted) | {
        answer.request_id for answer in observation.match_answers
        if answer.load_async and (observation.computed_tokens.get(answer.request_id, 0) or answer.request_id in loading)}
    asked = {answer.request_id for answer in observation.match_answers}
    considered = [r for r in resumed_or_admitted if r not in asked and r not in observation.promoted]
    for index, answer in enumerate(observation.match_answers):
        considered += [request_id for request_id, answers_before in observation.promoted.items()
                       if answers_before == index]
        if answer.request_id not in considered:  # else a failed load that freed its blocks, asked when taken up
            considered.append(answer.request_id)
    considered += [request_id for request_id, answers_before in observation.promoted.items()
                   if answers_before >= len(observation.match_answers)]
    return FollowedSchedule(scheduled_tokens=dict(observation.scheduled_tokens), considered=tuple(considered),
                            admitted=frozenset(admitted), preempted=frozenset(observation.preempted))


@dataclass
class ReferenceState:
    """The engine's state as the reference engine stepped alongside the adapter has it (the offloading level)."""

    engine: Engine

    def unfinished(self) -> list[str]:
        return sorted(request.request_id for request in (*self.engine.waiting, *self.engine.running))

    def loading(self) -> list[str]:
        return sorted(request.request_id for request in self.engine.waiting
                      if request.status is RequestStatus.WAITING_FOR_LOAD)

    def running(self) -> list[str]:
        return sorted(request.request_id for request in self.engine.running)

    def storing(self) -> list[str]:
        """Return the running requests whose stores are still in flight."""
        connector = self.engine.connector
        return [request_id for request_id in self.running() if any(
            connector.jobs[job].is_store for job in connector.states[request_id].transfer_jobs)]

    def transfers_pending(self) -> bool:
        return bool(self.engine.in_flight_job_count())

    def resident(self) -> list[str]:
        """Return the requests whose computed tokens' KV is in their GPU blocks: running, or with a load just done."""
        loaded = [request_id for request_id, success in self.engine.loads_done.items()
                  if success and not self.engine.requests[request_id].is_finished]
        return sorted({*self.running(), *loaded})

    def busy(self) -> bool:
        """Return True while the engine still has work for a step (SCHED-STEP-1) or a batch in flight."""
        return self.engine.has_work() or self.engine.in_flight is not None


@dataclass
class Replay:
    """A program as run: the calls the reference's state allowed, and the violation it ended with, if any."""

    program: list[Call]
    violation: ClauseViolation | None


def replay(session: Session, program: list[Call]) -> Replay:
    """Run `program` on a fresh adapter and reference, skipping the calls the reference's state does not allow.

    The coverage of a replay is not counted: it repeats calls a run has already judged. A known failure ends
    the replay there, without a violation (CONF-RUN-2); a hang or a call the reference itself refuses ends it
    with nothing run.
    """
    execution = Execution(session, coverage={})
    violation = None
    try:
        execution.begin()
        for call in program:
            if execution.allows(call):
                execution.apply(call)
    except ClauseViolation as error:
        violation = error
    except Diverged:
        pass
    except (AdapterHung, InvalidCall):
        execution.program.clear()
    finally:
        try:
            execution.close()
        except (ClauseViolation, AdapterHung, Diverged):
            pass
    return Replay(execution.program, violation)
