"""Running programs of engine operations on an adapter, judged at each spec level it reports (chapter `conformance`).

A program is a list of `Call`s: the adapter operations `start`, `add_request`, `step`, `complete_transfers`,
`abort`, `preempt`, `reset_prefix_cache` (and, for a producer/consumer pair, `prefill` and `decode`), plus `drain`
(complete transfers and step until the engine is idle, then check for leaks). The state machine draws programs,
the shrinker edits them, and a counterexample is one. `Execution.apply` runs one call on the adapter and hands every
operation and answer to one `Judge` per spec level, on the adapter's own schedule: the connector level from what
crosses the connector API (`judging/connector.py`), the offloading level against the reference engine stepped
alongside, which schedules as the adapter did and so knows what the connector and the store must do
(`judging/offloading.py`), and a pair of engines on both their schedules, joined by the params the harness forwards
(`judging/disaggregated.py`). An execution is the judges' `judging.judge.Run`: what they may ask of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from kvconform.adapters.contract import ImplementationFailure, KVConnectorAdapter
from kvconform.common.forwarding import forwarded_params
from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    RequestSpec,
    ResourceUsage,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance import exercise
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterCaller, AdapterHung
from kvconform.conformance.judging.judge import ClauseViolation, EngineState, Judge, Kind, checks_of
from kvconform.conformance.judging.levels import judges_for
from kvconform.conformance.operations import Call
from kvconform.conformance.recording import Recorder
from kvconform.reference.engine import Engine
from kvconform.reference.errors import InvalidCall

DRAIN_STEP_LIMIT = 64
"""Steps a drain may take, every transfer completed before each, before the requests still unfinished count as stuck
(LIFE-LIVE-1, KVC-LIVE-1): the bound where the harness completes transfers
(`Capabilities.harness_completes_transfers`)."""

DEFAULT_DRAIN_TIMEOUT = 10.0
"""Seconds a drain steps a connector on its own clock, as vLLM's engine core steps while requests wait for remote KV,
before what is still unreported, unfinished or held counts as stuck (KVC-ASYNC-1, KVC-LIVE-1, KVC-LEAK-1):
`--drain-timeout`. Ample for a connector's in-process threads; raise it for a connector that waits on a remote store."""

IDLE_STEP_PAUSE = 0.001
"""Seconds a drain on the connector's clock waits after a step that scheduled nothing, leaving its threads the CPU."""

Scheduling = Literal["sync", "async", "both"]
"""Which scheduling modes a run draws: sync only, async only, or both."""


class Diverged(Exception):
    """A known failure happened: the implementation and the reference have diverged, so the example ends
    (CONF-RUN-2). Raised from the known failure's violation."""

    @property
    def known_failure(self) -> ClauseViolation:
        """Return the violation of the known failure, which this was raised from."""
        if not isinstance(self.__cause__, ClauseViolation):
            raise RuntimeError(f"Diverged must be raised from a ClauseViolation, not {self.__cause__!r}")
        return self.__cause__


class RunStatistics(BaseModel):
    """What a run counted: examples, rules, steps, and where its time went. One value per run: the session adds to it,
    and the run's result and report carry it."""

    examples: int = Field(0, description="examples run: programs drawn, or replayed from the example database")
    found_at_example: int | None = Field(None, description="the example, counted from 1, in which the run found its "
                                                           "failure: 1 when the example database replayed it first")
    rules: int = Field(0, description="state-machine rules run (Hypothesis's stateful steps), each one or more "
                                      "adapter calls")
    steps: int = Field(0, description="engine steps judged: at the offloading level, compared with the reference's")
    steps_after_known_failure: int = Field(0, description="of those, the steps judged after a known failure of their "
                                                          "example, whose deviation the reference followed")
    adapter_seconds: float = Field(0.0, description="time in the adapter's calls")
    reference_seconds: float = Field(0.0, description="time in the reference engine stepped alongside")
    checks_seconds: float = Field(0.0, description="time in the checks")
    router_lookups: int = Field(0, description="lookups the router model predicted from the adapter's KV events "
                                               "(EVT-ROUTE-1)")
    router_blocks_predicted: int = Field(0, description="blocks of those lookups' hits the router held when they "
                                                        "were served (EVT-ROUTE-1)")
    router_blocks_served: int = Field(0, description="blocks of those lookups' hits the engine served: local and "
                                                     "external; any not predicted is a silent block, which fails")
    execution_seconds: float = Field(0.0, description="time building adapters and running programs' calls, engines "
                                                      "and checks included; the rest of a run is Hypothesis's rule "
                                                      "selection, draws and preconditions, and the state machine's own")

    def __add__(self, other: RunStatistics) -> RunStatistics:
        """Return the statistics of two parts of a run together; the failure was found in the first part's example."""
        total = {name: getattr(self, name) + getattr(other, name) for name in type(self).model_fields
                 if name != "found_at_example"}
        return RunStatistics(**total, found_at_example=self.found_at_example)


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
    reference: Callable[[EngineConfig], Engine] = Engine
    """Builds the reference engine the offloading level follows the adapter with: the spec's model."""
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds a drain waits for a connector on its own clock to go idle (`DEFAULT_DRAIN_TIMEOUT`)."""
    tensor_parallel_size: int | None = None
    """The ranks per engine a pair's run starts with (`--tensor-parallel-size`); None: drawn from those the adapter
    runs (PD-TP-1)."""
    coverage: dict[str, int] = field(default_factory=dict)
    exercise: exercise.Table = field(default_factory=dict)
    """How often the run drew each situation, per scheduling mode (`exercise.SITUATIONS`, CONF-CAP-1)."""
    findings: dict[str, str] = field(default_factory=dict)
    """Faults the engine's scheduler masked, by clause (`judging.connector.record_masked`): reported, not failed."""
    statistics: RunStatistics = field(default_factory=RunStatistics)
    observed_failure: ClauseViolation | None = None
    """The run's first failure as it happened, carrying its program: the evidence where a replay does not fail again,
    as happens with a connector on its own clock (CONF-RUN-3)."""
    capabilities: Capabilities | None = None
    """What the adapter claimed to support, as the latest execution read it (CONF-CAP-1)."""
    recorder: Recorder | None = None
    """Where the run's executions record what they do, for a run that writes a trace (`--record-trace`)."""
    clock: Callable[[], float] = time.monotonic
    """The run's clock: when a step was called (a lease's start), a drain's deadline; a checked trace's, its reads."""

    @property
    def adapter_capabilities(self) -> Capabilities:
        """Return what the adapter claimed to support, once an execution has read it (CONF-CAP-1)."""
        if self.capabilities is None:
            raise RuntimeError("the session has no adapter capabilities before an execution began")
        return self.capabilities


def drain_steps(harness_completes: bool, timeout: float, *, busy: Callable[[], bool],
                idle: Callable[[ResourceUsage], bool], complete: Callable[[], None],
                step: Callable[[], StepObservation], usage: Callable[[], ResourceUsage],
                clock: Callable[[], float] = time.monotonic) -> tuple[ResourceUsage, str]:
    """Step until the engine is idle; return the resource usage it ended with and how long the drain waited.

    Where the harness completes transfers (`harness_completes`), `complete` completes every one before each step, for
    at most `DRAIN_STEP_LIMIT` steps. A connector on its own clock finishes its transfers itself: the drain steps the
    engine as vLLM's engine core does while requests wait for remote KV, until it is idle or `timeout` seconds have
    passed, and what it waited says so (KVC-ASYNC-1, KVC-LIVE-1, KVC-LEAK-1). It steps while `busy`, then, asking the
    adapter's `usage` after each step, until `idle` by it: on its own schedule only the adapter knows its pending
    saves. On the connector's clock the deadline is read from `clock`."""
    started = 0.0 if harness_completes else clock()
    steps = 0

    def waiting() -> bool:
        return steps < DRAIN_STEP_LIMIT if harness_completes else clock() - started < timeout

    def one_step() -> None:
        nonlocal steps
        if harness_completes:
            complete()
        observation = step()
        steps += 1
        if not harness_completes and not observation.scheduled_tokens:
            time.sleep(IDLE_STEP_PAUSE)

    while waiting() and busy():
        one_step()
    current = usage()
    while waiting() and not idle(current):
        one_step()
        current = usage()
    waited = (f"{steps} drain steps with every transfer completed" if harness_completes else
              f"{steps} drain steps over {clock() - started:.2f} s on the connector's own clock (drain "
              f"deadline {timeout:g} s)")
    return current, waited


def drain(adapter: KVConnectorAdapter, timeout: float = DEFAULT_DRAIN_TIMEOUT) -> ResourceUsage:
    """Do on `adapter` what a program's `drain` does, judging nothing: complete every transfer before each step where
    the harness completes them, and step until the adapter's resource usage is all zero (`drain_steps`); return that
    usage. The `drain(adapter)` of a printed counterexample (`operations.render`): the kit's drain then checks for
    leaks and liveness, which `kvconform replay` of the program judges."""
    return drain_steps(adapter.capabilities().harness_completes_transfers, timeout, busy=lambda: False,
                       idle=lambda usage: not any(usage.model_dump().values()),
                       complete=lambda: adapter.complete_transfers(False, False), step=adapter.step,
                       usage=adapter.resource_usage)[0]



class Execution:
    """One fresh adapter driven through a program, its answers judged at every level it is judged at: the judges'
    `judging.judge.Run`."""

    def __init__(self, session: Session, coverage: dict[str, int] | None = None) -> None:
        self.session = session
        self.coverage = session.coverage if coverage is None else coverage
        self.exercise: exercise.Table = session.exercise if coverage is None else {}
        """Where the situations drawn are counted: the session's, but for a replay, whose calls a run has counted."""
        self.mode: exercise.Mode = "sync"
        self.replaying = coverage is not None
        """Whether the execution re-runs a program the run has judged (a shrink's replay), uncounted."""
        self.caller = AdapterCaller(session.call_timeout, session.recorder)
        self.judges: list[Judge] = []
        """One per level judged, the deeper level first; built at `start`."""
        self._state: EngineState | None = None
        self.capabilities = Capabilities()
        self.requests: dict[str, RequestSpec] = {}
        """The requests added so far, by id."""
        self.program: list[Call] = []
        self.failed = False
        self.deviated = False
        """Whether a known deviation of the adapter was followed earlier in this example."""
        self.observations: list[StepObservation] = []
        """The adapter's answers to the steps so far, for a scenario's expectations."""
        self.returned_params: dict[str, dict[str, Any] | None] = {}
        """A pair's finished producer requests -> the kv_transfer_params they returned (chapter `disaggregated`)."""
        self.step_called = 0.0
        """When the latest step was called (`time.monotonic`): what the adapter did in it began no earlier."""

    # --- the adapter ---------------------------------------------------------------------------

    def call(self, operation: str, *args: Any) -> Any:
        """Return the adapter's validated answer; a raise, a hang or a bad value fails its clause (`calls.py`)."""
        return self.outcome(operation, *args)[0]

    def outcome(self, operation: str, *args: Any) -> tuple[Any, bool]:
        """Return the adapter's validated answer to a call and whether the implementation failed it.

        An implementation failure of a known-failure clause yields the outcome the adapter reports when the
        implementation recovered; otherwise the example ends there (CONF-RUN-2).
        """
        try:
            return self.caller(operation, *args), False
        except ClauseViolation as violation:
            failure = violation.__cause__
            if not isinstance(failure, ImplementationFailure) or not self.session.baseline.tolerates(violation):
                raise
            if not failure.recovered:
                raise Diverged from violation
            return failure.result, True

    def begin(self) -> Capabilities:
        """Build the adapter and return what it claims to support (CONF-CAP-1)."""
        if self.session.recorder is not None:
            self.session.recorder.example(self.replaying)
        with self.executing():
            self.caller.build(self.session.adapter_factory)
            self.capabilities = self.session.capabilities = self.call("capabilities")
        return self.capabilities

    def close(self) -> None:
        with self.executing():
            if self.caller.adapter is not None and not self.caller.hung:
                self.call("close")
        self.session.statistics.adapter_seconds += self.caller.seconds

    @contextmanager
    def executing(self) -> Iterator[None]:
        """Count the time of the block as running the program (`RunStatistics.execution_seconds`); a clause violation
        leaving it carries the program run so far and the adapter calls made (`ClauseViolation.program`)."""
        started = time.perf_counter()
        try:
            yield
        except ClauseViolation as violation:
            if violation.program is None:
                violation.program, violation.calls = list(self.program), list(self.caller.trace)
            raise
        finally:
            self.session.statistics.execution_seconds += time.perf_counter() - started

    # --- what the engine's state allows ----------------------------------------------------------

    @property
    def started(self) -> bool:
        """Return True once the engine started: its judges are built."""
        return bool(self.judges)

    @property
    def state(self) -> EngineState:
        """Return where the engine's requests are, as the deepest level's judge follows them; set at `start`."""
        if self._state is None:
            raise RuntimeError("an execution has no engine state before its program's start call")
        return self._state

    def allows(self, call: Call) -> bool:
        """Return True if the engine's state lets `call` run: its request exists and is in the right state."""
        if call.operation == "start":
            return not self.started
        if not self.started:
            return False
        if call.operation in ("add_request", "prefill"):
            return call.args[0].request_id not in self.requests
        if call.operation == "decode":
            return call.args[0].request_id not in self.requests and call.args[1] in self.returned_params
        if call.operation == "abort":
            return self.capabilities.abort and call.args[0] in self.state.unfinished()
        if call.operation == "preempt":
            return self.capabilities.preemption and call.args[0] in self.state.running()
        return True

    # --- applying calls ------------------------------------------------------------------------

    def apply(self, call: Call) -> None:
        """Run `call` on the adapter and have every judge judge it; raise ClauseViolation on a failure."""
        self.program.append(call)
        if self.session.recorder is not None:
            self.session.recorder.operation(call)
        if self._state is not None:
            exercise.note(self.exercise, self.mode, call, self.state)
        try:
            with self.executing():
                getattr(self, f"_{call.operation}")(*call.args)
        except BaseException as error:
            self.failed = True
            statistics = self.session.statistics
            if isinstance(error, ClauseViolation) and statistics.found_at_example is None:
                statistics.found_at_example = statistics.examples
            if isinstance(error, ClauseViolation) and self.session.observed_failure is None:
                self.session.observed_failure = error
            raise

    def _start(self, config: EngineConfig) -> None:
        self.judges = judges_for(self, config)
        self._state = self.judges[0]
        self.mode = "async" if config.async_scheduling else "sync"
        self.call("start", config)

    def _add_request(self, spec: RequestSpec) -> None:
        self.requests[spec.request_id] = spec
        for judge in self.judges:
            judge.add_request(spec)
        self.call("add_request", spec)

    def _prefill(self, spec: RequestSpec) -> None:
        self.requests[spec.request_id] = spec
        for judge in self.judges:
            judge.prefill(spec)
        self.call("prefill", spec)

    def _decode(self, spec: RequestSpec, prefill_id: str, override: dict[str, Any] | None = None) -> None:
        """Have the adapter forward what request `prefill_id` returned, `override`'s fields in place, to the consumer;
        the judges are told the params it sends, computed alike from what the pair's steps reported (PD-PARAMS-2)."""
        if prefill_id not in self.requests:
            raise InvalidCall("PD-PARAMS-2", f"decode({spec.request_id!r}) forwards the params of {prefill_id!r}, "
                                             "which no prefill sent to the producer")
        params = forwarded_params(self.returned_params.get(prefill_id), override)
        self.requests[spec.request_id] = spec
        for judge in self.judges:
            judge.decode(spec, params)
        self.call("decode", spec, prefill_id, *([] if override is None else [override]))

    def _step(self, complete_transfers: TransferOutcome | None = None) -> StepObservation:
        self.step_called = self.now()
        actual = self.call("step", *([] if complete_transfers is None else [complete_transfers]))
        self.observations.append(actual)
        if actual.disaggregated is not None:
            self.returned_params.update(actual.disaggregated.producer.params)
        statistics = self.session.statistics
        statistics.steps += 1
        statistics.steps_after_known_failure += self.deviated
        for judge in self.judges:
            judge.step_observed(actual, complete_transfers)
        if self.capabilities.reads_kv:
            self.judge_resident_kv()
        return actual

    def _complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        for judge in self.judges:
            judge.complete_transfers(fail_loads, fail_stores)
        self.call("complete_transfers", fail_loads, fail_stores)

    def _abort(self, request_id: str) -> None:
        for judge in self.judges:
            judge.abort(request_id)
        self.call("abort", request_id)

    def _preempt(self, request_id: str) -> None:
        for judge in self.judges:
            judge.preempt(request_id)
        self.call("preempt", request_id)

    def _reset_prefix_cache(self, reset_connector: bool) -> None:
        """Reset as the adapter did: a connector reset the implementation failed and recovered from left the connector
        as it was, so the judges reset the prefix cache alone (OFF-MGR-8, CONF-RUN-2)."""
        answer, failed = self.outcome("reset_prefix_cache", reset_connector)
        for judge in self.judges:
            judge.reset_answered(reset_connector and not failed, answer)

    def _drain(self) -> None:
        """Step until the engine is idle, then check for leaks and liveness (`drain_steps`): the judges' state says
        when the engine is busy, the adapter's usage when it holds nothing more."""
        usage, waited = drain_steps(self.capabilities.harness_completes_transfers, self.session.drain_timeout,
                                    busy=self.state.busy, idle=self.state.idle,
                                    complete=lambda: self._complete_transfers(False, False), step=self._step,
                                    usage=lambda: self.call("resource_usage"), clock=self.now)
        for judge in self.judges:
            judge.drained(usage, waited)

    # --- what a judge may ask of the run (judging.judge.Run) ----------------------------------------

    def reference_engine(self, config: EngineConfig) -> Engine:
        return self.session.reference(config)

    def now(self) -> float:
        now = self.session.clock()
        if self.session.recorder is not None:
            self.session.recorder.clock(now)
        return now

    def timed_reference(self, seconds: float) -> None:
        self.session.statistics.reference_seconds += seconds

    def known_failures(self) -> Collection[str]:
        return self.session.baseline.entries

    def tolerates(self, violation: ClauseViolation) -> bool:
        return self.session.baseline.tolerates(violation)

    def followed_deviation(self) -> None:
        self.deviated = True

    def finding(self, clause: str, detail: str) -> None:
        self.session.findings.setdefault(clause, detail)

    def tally(self, figure: str, count: int) -> None:
        statistics = self.session.statistics
        setattr(statistics, figure, getattr(statistics, figure) + count)

    # --- judging -----------------------------------------------------------------------------

    def judge(self, call: str, kind: Kind, subject: object, *args: Any) -> None:
        """Run the checks of `kind` on the answer of `call`, with `subject` (what a judge's checks consult); a known
        failure is recorded, not raised, and ends the example: what would follow is only its consequences (CONF-RUN-2).

        A failure names the call whose answer it judged (CONF-CALL-1).
        """
        started = time.perf_counter()
        try:
            for each in checks_of(kind):
                each.function(subject, *args)
        except ClauseViolation as violation:
            violation.detail = f"{call}: {violation.detail}"
            if not self.session.baseline.tolerates(violation):
                raise
            raise Diverged from violation
        finally:
            self.session.statistics.checks_seconds += time.perf_counter() - started

    def judge_resident_kv(self) -> None:
        """Read the KV of every request that must hold its computed tokens' KV now, at some level, once, and have the
        judges of the levels that say so judge its bytes."""
        resident = [set(judge.resident()) for judge in self.judges]
        for request_id in sorted(set().union(*resident)):
            kv = self.call("computed_kv", request_id)
            for judge, requests in zip(self.judges, resident, strict=True):
                if request_id in requests:
                    judge.resident_kv(request_id, kv)


@dataclass
class Replay:
    """A program as run: the calls the reference's state allowed, and the violation it ended with, if any."""

    program: list[Call]
    violation: ClauseViolation | None

    @property
    def failure(self) -> ClauseViolation:
        """Return the violation of a replay that failed: the counterexample's."""
        if self.violation is None:
            raise RuntimeError("the replay ended without a violation: it is no counterexample")
        return self.violation


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
