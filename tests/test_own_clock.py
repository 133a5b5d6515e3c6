"""Connectors on their own clock (issue 22): the judge never assumes that the harness decides when a black box's
transfers complete, nondeterministic adapters get verdicts, and the own-clock test double with its twins runs
through `vllm-connector` (marked `vllm`)."""

from __future__ import annotations

import itertools
import time

import pytest
from click.testing import CliRunner
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    MatchAnswer,
    RequestSpec,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance import options, runner
from kvconform.conformance.connector_level import ConnectorJudge, check_async_loads
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.mutants import black_box

from kvconform.cli import main

PROMPT = (1, 2, 3, 0) * 4


class WallClockReference(black_box(ReferenceAdapter)):
    """The reference judged as a black box whose transfers finish on the wall clock, `latency` seconds after the
    first step that found them in flight: the harness cannot complete them."""

    latency = 0.3

    def capabilities(self) -> Capabilities:
        return super().capabilities().model_copy(update={"harness_completes_transfers": False,
                                                         "transfer_failures": False})

    def start(self, config: EngineConfig) -> None:
        super().start(config)
        self.since: float | None = None

    def complete_transfers(self, fail_loads: bool, fail_stores: bool) -> None:
        """Only the adapter's own clock completes its transfers."""

    def step(self, complete_transfers: TransferOutcome | None = None):
        if self.engine.in_flight_job_count() and self.since is None:
            self.since = time.monotonic()
        done = self.since is not None and time.monotonic() - self.since >= self.latency
        if done:
            self.since = None
        return super().step(TransferOutcome() if done else None)


class NeverCompletes(WallClockReference):
    latency = float("inf")


SAVE_THEN_LOAD = [Call("start", (EngineConfig(block_size_factor=1, num_offload_blocks=32),)),
                  Call("add_request", (RequestSpec(request_id="r0", prompt=PROMPT),)), Call("drain"),
                  Call("reset_prefix_cache", (False,)),
                  Call("add_request", (RequestSpec(request_id="r1", prompt=PROMPT),)), Call("drain")]
"""A prompt saved, the local prefix cache reset, the prompt again: its load and both drains wait for the clock."""


def test_drain_waits_for_the_connectors_clock_not_a_step_count() -> None:
    """False alarm 1: a load that finishes on the wall clock, later than 64 quick drain steps, is no liveness failure."""
    ran = replay(Session(WallClockReference), SAVE_THEN_LOAD)
    assert ran.violation is None, ran.violation
    assert ran.program == SAVE_THEN_LOAD


def test_a_load_never_reported_fails_after_the_drain_deadline_saying_how_long_it_waited() -> None:
    """Bad input: a connector that never reports its transfers fails KVC-LEAK-1 or KVC-ASYNC-1 at the deadline, with
    the wait in the message, and never hangs."""
    started = time.monotonic()
    violation = replay(Session(NeverCompletes, drain_timeout=0.5), SAVE_THEN_LOAD).violation
    assert violation is not None and violation.clause in ("KVC-ASYNC-1", "KVC-LEAK-1", "KVC-LIVE-1")
    assert "drain deadline 0.5 s" in violation.detail, violation.detail
    assert time.monotonic() - started < 10


def admitted_and_reported_in_one_step() -> StepObservation:
    return StepObservation(scheduled_tokens={}, computed_tokens={"r": 8}, loads_finished=("r",),
                           match_answers=(MatchAnswer(request_id="r", local_hit_tokens=0, external_tokens=8,
                                                      load_async=True),))


def test_a_load_reported_in_the_step_that_admitted_it_is_accepted() -> None:
    """False alarm 3: vLLM accepts a finished load whatever step it began in (`_update_from_kv_xfer_finished`)."""
    judge = ConnectorJudge(EngineConfig(), {})
    judge.add_request(RequestSpec(request_id="r", prompt=PROMPT))
    observation = admitted_and_reported_in_one_step()
    check_async_loads(judge, observation)
    judge.follow(observation)
    assert not judge.trace.loading and judge.trace.loaded == {"r"}


class ClockChangesReference(WallClockReference):
    """Transfers finish at once until one step reports a load and also a failed load of a request that has none
    (KVC-FAIL-1), in the run's third engine or later; from then on they take 50 ms, so no replay fails again: a
    Hypothesis replay of the failing example meets other loads in flight at every step."""

    engines_built = itertools.count()
    faulted = False

    @property
    def latency(self) -> float:
        return 0.05 if ClockChangesReference.faulted else 0.0

    def start(self, config: EngineConfig) -> None:
        super().start(config)
        self.engine_number = next(self.engines_built)

    def step(self, complete_transfers: TransferOutcome | None = None):
        observation = super().step(complete_transfers)
        if self.engine_number >= 2 and not ClockChangesReference.faulted and observation.loads_finished:
            ClockChangesReference.faulted = True
            return observation.model_copy(update={"loads_failed": ("ghost",)})
        return observation


def test_a_failure_no_replay_reproduces_is_a_verdict_on_the_observed_trace() -> None:
    """False alarm 2: with an adapter on its own clock, Hypothesis's draws never depend on its timing (no
    FlakyStrategyDefinition); the failure is judged on the trace observed, reported with it as the counterexample,
    and the message says how many replays reproduced it."""
    result = runner.run(ClockChangesReference, "clock-changes", "smoke", seed=1)
    assert result.failed_clause == "KVC-FAIL-1", f"[{result.failed_clause}] {result.message}"
    assert "0 of 3 replays" in result.message
    assert "adapter.add_request(" in result.counterexample


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_drain_timeout_that_is_not_a_positive_number_is_one_line_exit_2(value: str) -> None:
    result = CliRunner().invoke(main, ["run", "--adapter", "reference", "--drain-timeout", value])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "drain timeout must be a positive number" in result.output


def test_the_drain_deadline_is_in_the_report_of_a_connector_on_its_own_clock() -> None:
    run = options.prepare(f"{__name__}:WallClockReference", profile="smoke", drain_timeout="2.5")
    assert run.drain_timeout == 2.5
