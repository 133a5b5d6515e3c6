"""Run the conformance state machine against one adapter, or check the trace of a run, and collect a verdict per
clause."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import reporting
from hypothesis import seed as use_seed
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky, HypothesisException
from hypothesis.stateful import run_state_machine_as_test

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.common.trace import TraceError
from kvconform.common.values import Capabilities, SpecLevel
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterHung, hang_detection
from kvconform.conformance.execution import (
    DEFAULT_DRAIN_TIMEOUT,
    Diverged,
    Execution,
    RunStatistics,
    Scheduling,
    Session,
)
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.machine import machine_for
from kvconform.conformance.operations import Call, render, requests_created
from kvconform.conformance.playback import Playback, Trace, traced_factory
from kvconform.conformance.profiles import PROFILES, Profile, Shard, profile_settings, programs_from_seed_alone
from kvconform.conformance.recording import Recorder
from kvconform.conformance.shrinker import Failure, Replay, Shrinker, fails_as, size
from kvconform.reference.errors import InvalidCall

Outcome = Literal["ok", "fail", "info"]
"""Jepsen's outcomes: conformant, a clause failed, or unknown (an adapter call never returned, CONF-CALL-2)."""


@dataclass
class RunResult:
    """The outcome of one conformance run."""

    adapter: str
    profile: str
    seed: int | None
    passed: bool
    seconds: float
    scheduling: Scheduling = "both"
    found_after: float | None = None
    statistics: RunStatistics = field(default_factory=RunStatistics)
    coverage: dict[str, int] = field(default_factory=dict)
    exercise: dict[str, dict[str, int]] = field(default_factory=dict)
    """How often the run drew each situation, per scheduling mode (`exercise.SITUATIONS`)."""
    failed_clause: str | None = None
    message: str | None = None
    counterexample: str | None = None
    program: list[dict] | None = None
    adapter_traceback: str | None = None
    known_failures: dict[str, str] = field(default_factory=dict)
    known_failures_met: dict[str, int] = field(default_factory=dict)
    """Every listed known-failure entry by name -> how many failures it covered (CONF-RUN-2)."""
    levels: tuple[SpecLevel, ...] = ()
    """The spec levels the run judged: those the adapter reports (`Capabilities.levels`)."""
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds a drain waited at most for a connector on its own clock to go idle."""
    findings: dict[str, str] = field(default_factory=dict)
    """Faults of answers the release's scheduler replaced before using them, by clause: they fail on other releases."""

    @property
    def outcome(self) -> Outcome:
        return "ok" if self.passed else "info" if self.failed_clause == AdapterHung.clause else "fail"

    @property
    def counterexample_calls(self) -> list[Call]:
        """Return the calls of the shrunk counterexample's program; none for a run that failed before its engine
        started, or hung (its counterexample is the adapter calls made, not a program)."""
        return [Call.from_json(operation) for operation in self.program or ()]

    @property
    def counterexample_requests(self) -> int:
        """Return how many requests the shrunk counterexample creates (`add_request`, `prefill`, `decode`)."""
        return requests_created(self.counterexample_calls)


def run(
    adapter_factory: Callable[[], KVConnectorAdapter],
    adapter_name: str,
    profile: str = "ci",
    seed: int | None = None,
    on_example: Callable[[], None] | None = None,
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
    baseline: Baseline | None = None,
    scheduling: Scheduling = "both",
    database: ExampleDatabase | None = None,
    shard: Shard = Shard(),
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    on_shrink: Callable[[str], None] | None = None,
    tensor_parallel_size: int | None = None,
    capabilities: Capabilities | None = None,
    recorder: Recorder | None = None,
) -> RunResult:
    """Run the state machine under `profile`; a clause violation becomes a failed result with its counterexample.

    Failing examples stored in `database` (one kind of run's, `examples.RunExamples`) are replayed first, and the
    run's own failure is stored there (CONF-RUN-5). A `shard` of a split run draws its share of the examples from
    its own seed. A shrink that lasts says how far it got to `on_shrink`, every `shrinker.PROGRESS_SECONDS`. A
    `recorder` writes the run's trace, which `check` judges again.
    """
    baseline = Baseline() if baseline is None else baseline
    session = Session(adapter_factory, call_timeout, scheduling, baseline, on_example, drain_timeout=drain_timeout,
                      tensor_parallel_size=tensor_parallel_size, capabilities=capabilities, recorder=recorder)
    machine = machine_for(session)
    seed = shard.seed(seed)
    if seed is not None:  # @seed also sets database=None on the class's own settings, which the settings below replace
        use_seed(seed)(machine)
    settings = profile_settings(profile, seed is not None, database, shard.examples(PROFILES[profile].max_examples))
    started = time.perf_counter()
    result = RunResult(adapter_name, profile, seed, passed=True, seconds=0.0, scheduling=scheduling,
                       statistics=session.statistics, coverage=session.coverage, exercise=session.exercise,
                       drain_timeout=drain_timeout, findings=session.findings)
    try:
        # Hypothesis reports nothing: the result reports the call program
        with reporting.with_reporter(lambda text: None), programs_from_seed_alone(), hang_detection():
            run_state_machine_as_test(machine, settings=settings)
    except ClauseViolation as violation:
        result.found_after = time.perf_counter() - started
        _failed(result, _shrunk(session, Replay(violation.executed_program, violation), PROFILES[profile],
                                on_shrink))
    except AdapterHung as hang:  # not shrunk: the unshrunk calls that led to the hang are the evidence
        _hung(result, hang)
    except HypothesisException as error:
        observed = _not_replayed(error, session)
        if observed is not None:
            result.found_after = time.perf_counter() - started
            _failed(result, _shrunk(session, observed, PROFILES[profile], on_shrink))
        else:
            result.passed = False
            result.failed_clause = "CONF-RUN-1"
            result.message = f"{type(error).__name__}: {error}"
    finally:
        if recorder is not None:
            recorder.close(session.statistics.examples, session.statistics.rules)
    _concluded(result, baseline, session, started)
    return result


def check(trace: Trace, baseline: Baseline, on_example: Callable[[], None] | None = None) -> RunResult:
    """Judge the run `trace` recorded again, on its recorded schedule: every example's program applied to an adapter
    that answers as the recorded one did, by the same judges as a live run (`kvconform check`).

    The verdict is the live runner's: the failure of the last drawn example that failed (the one Hypothesis
    reported), shown by the smallest program any example failed alike with (the shrinker's). A call with no recorded
    outcome is unknown (CONF-CALL-2); a record the run cannot place raises `playback.TraceMismatch`.
    """
    recorded = trace.run
    session = Session(traced_factory(Playback(trace.path, [])), None, recorded["scheduling"], baseline,
                      drain_timeout=recorded["drain_timeout"], tensor_parallel_size=recorded["tensor_parallel_size"])
    result = RunResult(recorded["adapter"], recorded["profile"], recorded["seed"], passed=True, seconds=0.0,
                       scheduling=recorded["scheduling"], statistics=session.statistics, coverage=session.coverage,
                       exercise=session.exercise, drain_timeout=recorded["drain_timeout"], findings=session.findings)
    started = time.perf_counter()
    drawn: list[Replay] = []
    replayed: list[Replay] = []
    try:
        for replaying, records in trace.examples:
            playback = Playback(trace.path, records)
            session.adapter_factory, session.clock = traced_factory(playback), playback.now
            if not replaying:
                session.statistics.examples += 1
                if on_example is not None:
                    on_example()
            failing = _played(session, playback, replaying)
            if failing is not None:
                (replayed if replaying else drawn).append(failing)
    except AdapterHung as hang:
        _hung(result, hang)
    else:
        _check_end(trace, session.statistics)
        if drawn:
            failure = Failure.of(drawn[-1].failure)
            alike = [replay for replay in replayed if fails_as(replay, failure)]
            _failed(result, min([drawn[-1], *alike], key=lambda replay: size(replay.program)))
    _concluded(result, baseline, session, started)
    return result


def judge_recording(adapter_factory: Callable[[], KVConnectorAdapter], program: list[Call], baseline: Baseline,
                    adapter: str, tensor_parallel_size: int) -> RunResult:
    """Judge the one program a recorded engine ran (`adapters/vllm/recorded.py`) on an adapter that answers as the
    engine did, by the judges of a live run, as one example: its drain, if the recording reached the engine's
    shutdown, checks what the engine held then at once (a drain timeout of 0: the recording has no later step)."""
    session = Session(adapter_factory, None, "sync", baseline, drain_timeout=0.0,
                      tensor_parallel_size=tensor_parallel_size)
    result = RunResult(adapter, "recorded", None, passed=True, seconds=0.0, scheduling="sync",
                       statistics=session.statistics, coverage=session.coverage, exercise=session.exercise,
                       drain_timeout=0.0, findings=session.findings)
    started = time.perf_counter()
    session.statistics.examples = 1
    execution = Execution(session)
    try:
        execution.begin()
        for call in program:
            execution.apply(call)
    except ClauseViolation as violation:
        _failed(result, Replay(execution.program, violation))
    except Diverged:
        pass
    finally:
        execution.close()
    _concluded(result, baseline, session, started, judged_whole=False)
    return result


def _check_end(trace: Trace, statistics: RunStatistics) -> None:
    """Raise TraceError unless the trace ends as the run did: with its end record, after the examples it counts."""
    if trace.end is None:
        raise TraceError(f"{trace.path}: the trace has no end record: the recording stopped before the run did, and "
                         "what the run did after its last record is unknown")
    if trace.end["examples"] != statistics.examples:
        raise TraceError(f"{trace.path}: the end record counts {trace.end['examples']} examples, and the trace holds "
                         f"{statistics.examples}")
    statistics.rules = trace.end["rules"]


def _played(session: Session, playback: Playback, replaying: bool) -> Replay | None:
    """Play one example back as the run made it (the state machine's example, or a shrink's replay); return its
    failure, if it failed. A failure in closing the adapter counts for a drawn example, as it fails its teardown."""
    execution = Execution(session, coverage={} if replaying else None)
    violation = None
    try:
        execution.begin()
        while playback.at("operation"):
            execution.apply(playback.operation())
    except ClauseViolation as error:
        violation = error
        playback.abandon()
    except (Diverged, InvalidCall):
        playback.abandon()
    try:
        execution.close()
    except ClauseViolation as error:
        violation = violation or (None if replaying else error)
    except Diverged:
        pass
    playback.finished()
    return None if violation is None else Replay(execution.program, violation)


def _concluded(result: RunResult, baseline: Baseline, session: Session, started: float, *,
               judged_whole: bool = True) -> None:
    """Complete a result as every run ends: the known failures met, stale entries, time and levels (CONF-RUN-2). A
    recording (not `judged_whole`) reached what its engine did, not every situation: an entry it did not meet is not
    stale."""
    if result.failed_clause in baseline.entries:
        result.message = (f"{result.message} (the known failures list {result.failed_clause} for another cause only: "
                          f"{', '.join(e.name for e in baseline.listed if e.clause == result.failed_clause)})")
    result.known_failures = dict(baseline.seen)
    result.known_failures_met = {entry.name: baseline.met[entry.name] for entry in baseline.listed}
    if result.passed and judged_whole and baseline.stale():
        result.passed = False
        result.failed_clause = "CONF-RUN-2"
        result.message = f"known failures that no longer fail (stale baseline entries): {', '.join(baseline.stale())}"
    result.seconds = time.perf_counter() - started
    if session.capabilities is not None:
        result.levels = session.capabilities.levels


def _hung(result: RunResult, hang: AdapterHung) -> None:
    """Record a call with no outcome (CONF-CALL-2): its evidence is the unshrunk calls that led to it."""
    result.passed = False
    result.failed_clause = hang.clause
    result.message = hang.detail
    result.counterexample = "\n".join(hang.trace)


def _failed(result: RunResult, failing: Replay) -> None:
    """Record a failure; before the engine started, the calls that failed stand for the program."""
    result.passed = False
    violation = failing.failure
    result.failed_clause = violation.clause
    result.message = violation.detail
    result.counterexample = render(failing.program) or "\n".join(violation.calls)
    result.program = [call.to_json() for call in failing.program]
    result.adapter_traceback = violation.adapter_traceback


def _not_replayed(error: HypothesisException, session: Session) -> Replay | None:
    """Return the failure the run observed, with the program as it ran, where `error` says Hypothesis could not make
    it happen again: an adapter that is not deterministic, such as a connector on its own clock (CONF-RUN-3). The
    shrinker then replays it and says how many of its replays reproduced it."""
    observed = session.observed_failure
    if not isinstance(error, Flaky) or observed is None or observed.program is None:
        return None
    return Replay(observed.program, observed)


def _shrunk(session: Session, failing: Replay, profile: Profile,
            on_progress: Callable[[str], None] | None = None) -> Replay:
    """Return the failing program shrunk within the profile's budget (CONF-RUN-3), saying how far it got to
    `on_progress` while it lasts."""
    if not failing.program:
        return failing
    return Shrinker(session, session.adapter_capabilities, profile.shrink_attempts,
                    on_progress=on_progress).shrink(failing)
