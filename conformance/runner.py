"""Run the conformance state machine against one adapter and collect a verdict per clause."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import reporting
from hypothesis.errors import HypothesisException
from hypothesis.stateful import run_state_machine_as_test

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT, AdapterHung
from kvconform.conformance.checks import ClauseViolation
from kvconform.conformance.machine import Scheduling, Session, machine_for
from kvconform.conformance.profiles import profile_settings


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
    steps: int = 0
    adapter_seconds: float = 0.0
    reference_seconds: float = 0.0
    coverage: dict[str, int] = field(default_factory=dict)
    failed_clause: str | None = None
    message: str | None = None
    counterexample: str | None = None
    adapter_traceback: str | None = None
    known_failures: dict[str, str] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        return "ok" if self.passed else "info" if self.failed_clause == AdapterHung.clause else "fail"

    @property
    def counterexample_requests(self) -> int:
        """Return how many requests the shrunk counterexample adds."""
        return (self.counterexample or "").count("adapter.add_request(")


def run(
    adapter_factory: Callable[[], KVConnectorAdapter],
    adapter_name: str,
    profile: str = "ci",
    seed: int | None = None,
    on_example: Callable[[], None] | None = None,
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
    baseline: Baseline | None = None,
    scheduling: Scheduling = "both",
) -> RunResult:
    """Run the state machine under `profile`; a clause violation becomes a failed result with its counterexample."""
    baseline = Baseline() if baseline is None else baseline
    session = Session(adapter_factory, call_timeout, scheduling, baseline, on_example)
    machine = machine_for(session)
    if seed is not None:
        machine._hypothesis_internal_use_seed = seed
    started = time.perf_counter()
    result = RunResult(adapter_name, profile, seed, passed=True, seconds=0.0, scheduling=scheduling,
                       coverage=session.coverage)
    try:
        with reporting.with_reporter(lambda text: None):  # the counterexample is the adapter's call program
            run_state_machine_as_test(machine, settings=profile_settings(profile, seed is not None))
    except ClauseViolation as violation:
        result.passed = False
        result.failed_clause = violation.clause
        result.message = violation.detail
        result.counterexample = session.last_caller.counterexample()
        result.adapter_traceback = violation.adapter_traceback
    except AdapterHung as hang:  # not shrunk: the unshrunk calls that led to the hang are the evidence
        result.passed = False
        result.failed_clause = hang.clause
        result.message = hang.detail
        result.counterexample = "\n".join(hang.trace)
    except HypothesisException as error:
        result.passed = False
        result.failed_clause = "CONF-RUN-1"
        result.message = f"{type(error).__name__}: {error}"
    result.known_failures = dict(baseline.seen)
    if result.passed and baseline.stale():
        result.passed = False
        result.failed_clause = "CONF-RUN-2"
        result.message = f"known failures that no longer fail (stale baseline entries): {', '.join(baseline.stale())}"
    result.seconds = time.perf_counter() - started
    result.steps = session.steps
    result.adapter_seconds, result.reference_seconds = session.adapter_seconds, session.reference_seconds
    return result
