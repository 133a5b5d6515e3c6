"""Connectors on their own clock (issue 22): the judge never assumes that the harness decides when a black box's
transfers complete, nondeterministic adapters get verdicts, and the own-clock test double with its twins runs
through `vllm-connector` (marked `vllm`)."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable

import pytest
import torch
from click.testing import CliRunner

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.registry import AdapterNotFound
from kvconform.adapters.vllm import runtime
from kvconform.cli import main
from kvconform.common.values import (
    Capabilities,
    EngineConfig,
    MatchAnswer,
    RequestSpec,
    StepObservation,
    TransferOutcome,
)
from kvconform.conformance import options, report, runner
from kvconform.conformance.execution import Execution, Session, replay
from kvconform.conformance.judging.connector import (
    MASKED_FAULTS,
    ConnectorJudge,
    check_answer_range,
    check_async_loads,
    check_delayed_frees,
    check_load_failures,
    check_resident_bytes,
    check_skip_read_black_box,
)
from kvconform.conformance.judging.judge import ClauseViolation
from kvconform.conformance.mutants import black_box
from kvconform.conformance.operations import Call

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
    """False alarm 1: a load that finishes on the wall clock, later than 64 quick drain steps, is no liveness
    failure."""
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


def judge_of(spec: RequestSpec) -> ConnectorJudge:
    """Return the connector-level judge of an execution to which the harness added `spec`."""
    execution = Execution(Session(ReferenceAdapter))
    judge = ConnectorJudge(execution, EngineConfig())
    execution.requests[spec.request_id] = spec
    judge.add_request(spec)
    return judge


def test_a_load_reported_in_the_step_that_admitted_it_is_accepted() -> None:
    """False alarm 3: vLLM accepts a finished load whatever step it began in (`_update_from_kv_xfer_finished`)."""
    judge = judge_of(RequestSpec(request_id="r", prompt=PROMPT))
    observation = admitted_and_reported_in_one_step()
    check_async_loads(judge, observation)
    judge.follow(observation)
    assert not judge.trace.loading and judge.trace.loaded == {"r"}


def test_a_load_admitted_and_failed_in_one_step_is_accepted() -> None:
    """A load that fails in the step that admitted it is reported finished and failed there, and its request counts
    its local hit only: vLLM accepts it, so neither KVC-ASYNC-1 nor KVC-FAIL-1 fails (the reference does this when
    its transfers complete inside the step)."""
    judge = judge_of(RequestSpec(request_id="r", prompt=PROMPT))
    observation = StepObservation(scheduled_tokens={}, computed_tokens={"r": 0}, loads_finished=("r",),
                                  loads_failed=("r",), match_answers=(MatchAnswer(
                                      request_id="r", local_hit_tokens=0, external_tokens=4, load_async=True),))
    check_async_loads(judge, observation)
    check_load_failures(judge, observation)
    judge.follow(observation)
    assert not judge.trace.loading


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


# --- module:Class from the current directory ----------------------------------------------------


def test_an_unknown_connector_module_is_refused_before_vllm_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vendor's first hour: `--connector mymod:Class` that names no module fails at once, not after vLLM's import."""
    from kvconform.adapters.vllm.connector import VllmConnectorAdapter

    monkeypatch.setattr(runtime, "load", lambda: pytest.fail("vLLM was imported"))
    monkeypatch.setenv("KVCONFORM_CONNECTOR", "no_such_connector_module:Connector")
    with pytest.raises(AdapterNotFound, match="no_such_connector_module.*current directory"):
        VllmConnectorAdapter()


def test_a_connector_module_resolves_from_the_current_directory(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from kvconform.adapters.vllm.connector import _find_module

    (tmp_path / "vendor_connector_here.py").write_text("class Connector: ...\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    _find_module("vendor_connector_here")
    assert str(tmp_path) in sys.path


# --- the own-clock double through vllm-connector (issue 22) ---------------------------------------

VLLM = runtime.installed_version()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed: kvconform install-vllm 0.24.0")
DOUBLE = "tests.own_clock_connector"


@pytest.fixture
def own_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], type]:
    """Return `vllm-connector` with the double's class `name` selected, as `--connector` selects it."""

    def select(name: str) -> type:
        monkeypatch.setenv("KVCONFORM_CONNECTOR", f"{DOUBLE}:{name}")
        for variable in ("KVCONFORM_CONNECTOR_CONFIG", "KVCONFORM_CONNECTOR_MANIFEST"):
            monkeypatch.delenv(variable, raising=False)
        from kvconform.adapters.vllm.connector import VllmConnectorAdapter

        return VllmConnectorAdapter

    return select


def reload_after_reset(skip_read: bool = False, async_scheduling: bool = False) -> list[Call]:
    """A prompt saved, the local prefix cache reset, the same prompt again, maybe one that must not read it."""
    config = EngineConfig(block_size_factor=1, num_offload_blocks=32, async_scheduling=async_scheduling)
    return [Call("start", (config,)),
            Call("add_request", (RequestSpec(request_id="r0", prompt=PROMPT),)), Call("drain"),
            Call("reset_prefix_cache", (False,)),
            Call("add_request", (RequestSpec(request_id="r1", prompt=PROMPT, skip_reading_prefix_cache=skip_read),)),
            Call("drain")]


@pytest.mark.vllm
@needs_vllm
def test_a_load_reported_twice_is_kvc_async_1_before_vllms_assertion(own_clock: Callable[[str], type]) -> None:
    """Issue 22 item 6: the double report is the connector's fault, named by its clause, not vLLM's bare
    AssertionError under CONF-CALL-1."""
    violation = replay(Session(own_clock("ReportsLoadTwice")), reload_after_reset()).violation
    assert violation is not None and violation.clause == "KVC-ASYNC-1", violation
    assert "no load of it is in flight" in violation.detail


@pytest.mark.vllm
@needs_vllm
def test_a_connector_whose_thread_raises_fails_with_the_threads_traceback(own_clock: Callable[[str], type]) -> None:
    """Bad input: the error of a transfer thread is reported under the clause of the call that observed it."""
    violation = replay(Session(own_clock("LoadThreadRaises")), reload_after_reset()).violation
    assert violation is not None and violation.clause == "CONF-CALL-1", violation
    assert "OSError: the store server went away" in violation.adapter_traceback


@pytest.mark.vllm
@needs_vllm
def test_a_skip_read_answer_the_scheduler_replaces_is_a_finding_not_a_failure(own_clock: Callable[[str], type]) -> None:
    """Item 5, issue 24: where the release's scheduler answers a skip-read request itself (found in its code), the
    connector's own answer is a finding; where it trusts the connector, the same answer fails KVC-SKIP-1."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvconform.adapters.vllm.engine import skip_read_condition

    session = Session(own_clock("IgnoresSkipRead"))
    violation = replay(session, reload_after_reset(skip_read=True)).violation
    if skip_read_condition(Scheduler) is None:
        assert violation is not None and violation.clause == "KVC-SKIP-1", violation
    else:
        assert violation is None, violation
        assert "masked by this release's scheduler" in session.findings["KVC-SKIP-1"]


@pytest.mark.vllm
@needs_vllm
def test_a_double_whose_manifest_denies_its_delayed_frees_fails_kvc_free_1(own_clock: Callable[[str], type],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's `never` verified at run time on a real connector: the double delays the free of a request with
    saves in flight, so declaring `never: delays_free` for it fails KVC-FREE-1 (the twin is the lying manifest)."""
    adapter = own_clock("OwnClockConnector")
    monkeypatch.setenv("KVCONFORM_CONNECTOR_MANIFEST", '{"never": ["delays_free"]}')
    violation = replay(Session(adapter), reload_after_reset()).violation
    assert violation is not None and violation.clause == "KVC-FREE-1", violation
    assert "never: delays_free" in violation.detail


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_double_reloads_what_it_saved_on_its_own_clock(own_clock: Callable[[str], type],
                                                           async_scheduling: bool) -> None:
    """The correct double: a saved prompt comes back through an asynchronous load its thread reports, bytes right."""
    execution = Execution(Session(own_clock("OwnClockConnector")))
    execution.begin()
    for call in reload_after_reset(async_scheduling=async_scheduling):
        execution.apply(call)
    execution.close()
    assert execution.coverage["KVC-ASYNC-1"] >= 1 and execution.coverage["KVC-DATA-1"] >= 1


@pytest.mark.long
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_the_own_clock_double_conforms(own_clock: Callable[[str], type], scheduling: str) -> None:
    """A correct connector with threads passes, in either scheduling mode, with no failure at all."""
    result = runner.run(own_clock("OwnClockConnector"), "own-clock", "ci", scheduling=scheduling)
    assert result.passed, f"[{result.failed_clause}] {result.message}\n{result.counterexample}"
    assert {"KVC-ASYNC-1", "KVC-DATA-1", "KVC-HIT-1", "KVC-FREE-1"} <= set(result.coverage)


TWINS = {"ReportsLoadTwice": ("KVC-ASYNC-1",), "ReportsLoadBeforeCopy": ("KVC-DATA-1",),
         "TenantBlindKey": ("KVC-HIT-1", "KVC-DATA-1"), "AnswersPastThePrompt": ("KVC-MATCH-1",)}
"""The double's twins and the clauses that kill them; IgnoresSkipRead has a test of its own (masked on 0.34)."""


@pytest.mark.long
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("twin", sorted(TWINS))
def test_a_twin_of_the_double_is_killed_by_its_clause(own_clock: Callable[[str], type], twin: str) -> None:
    result = runner.run(own_clock(twin), twin, "ci")
    assert result.failed_clause in TWINS[twin], f"{twin}: [{result.failed_clause}] {result.message}"


def test_wrong_bytes_name_the_load_its_steps_and_the_preemption_before_it() -> None:
    """Issue 22 item 6: KVC-DATA-1 says which load brought the bytes, when, and the preemption that led to it."""
    judge = judge_of(RequestSpec(request_id="r", prompt=PROMPT))
    judge.follow(StepObservation(scheduled_tokens={"r": 4}, computed_tokens={"r": 4}))
    judge.follow(StepObservation(scheduled_tokens={}, computed_tokens={"r": 0}, preempted=("r",)))
    judge.follow(StepObservation(scheduled_tokens={}, computed_tokens={"r": 8}, match_answers=(
        MatchAnswer(request_id="r", local_hit_tokens=0, external_tokens=8, load_async=True),)))
    judge.follow(StepObservation(scheduled_tokens={}, computed_tokens={"r": 8}, loads_finished=("r",)))
    with pytest.raises(ClauseViolation) as raised:
        check_resident_bytes(judge, "r", torch.zeros(8, EngineConfig().token_width, dtype=torch.float16))
    assert ("step 4; tokens 0-8 loaded asynchronously, admitted in step 3, reported finished in step 4; "
            "preempted in step 2") in raised.value.detail


@pytest.mark.parametrize("skip_read, external, num_tokens, kind", [
    (True, 4, None, "skip-read answered"), (False, -4, None, "negative count"),
    (False, 16, 16, "synchronous hit of every token")])
def test_a_masked_finding_names_where_it_fails_from_the_known_releases(skip_read: bool, external: int,
                                                                       num_tokens: int | None, kind: str) -> None:
    """Issue 22 item 5: a masked answer's finding names its kind and the releases and load modes where it fails, as
    `MASKED_FAULTS` records them, not one literal for every fault."""
    judge = judge_of(RequestSpec(request_id="r", prompt=PROMPT, skip_reading_prefix_cache=skip_read))
    answer = MatchAnswer(request_id="r", local_hit_tokens=0, external_tokens=external, load_async=False,
                         num_tokens=num_tokens)
    observation = StepObservation(scheduled_tokens={}, computed_tokens={}, masked_answers=(answer,),
                                  match_answers=(answer.model_copy(update={"external_tokens": 0}),))
    check_answer_range(judge, observation)
    check_skip_read_black_box(judge, observation)
    finding = judge.run.session.findings["KVC-SKIP-1" if skip_read else "KVC-MATCH-1"]
    assert f"as a {kind} it fails on {MASKED_FAULTS[kind][1]}" in finding, finding


@pytest.mark.vllm
@needs_vllm
def test_a_synchronous_hit_of_every_token_is_kvc_match_1_before_the_assertion(own_clock: Callable[[str], type]) -> None:
    """Issue 22: a synchronous load of a whole prompt leaves no token to compute; the connector's fault is named by its
    clause, not vLLM's bare `assert num_new_tokens > 0` under CONF-CALL-1."""
    violation = replay(Session(own_clock("LoadsAllSynchronously")), reload_after_reset()).violation
    assert violation is not None and violation.clause == "KVC-MATCH-1", violation
    assert "a synchronous load of all of them" in violation.detail, violation.detail


FAILED_LOAD = StepObservation(scheduled_tokens={}, computed_tokens={"r": 0}, loads_finished=("r",), loads_failed=("r",),
                              match_answers=(MatchAnswer(request_id="r", local_hit_tokens=0, external_tokens=4,
                                                         load_async=True),))
DELAYED_FREE = StepObservation(scheduled_tokens={}, computed_tokens={}, finished=("r",), free_delayed=("r",))


@pytest.mark.parametrize("never, observation, check", [("fails_load", FAILED_LOAD, check_load_failures),
                                                       ("delays_free", DELAYED_FREE, check_delayed_frees)])
def test_a_connector_that_does_what_its_manifest_says_it_never_does_fails_the_clause(
        never: str, observation: StepObservation, check: Callable[..., None]) -> None:
    """Issue 22 item 6: the manifest's `never` is verified at run time: a failed load or a delayed free observed from a
    connector that declared it never does them fails KVC-FAIL-1 or KVC-FREE-1; undeclared, the same step passes."""
    judge = judge_of(RequestSpec(request_id="r", prompt=PROMPT))
    check(judge, observation)
    judge.run.capabilities = Capabilities(never=(never,))
    with pytest.raises(ClauseViolation) as raised:
        check(judge, observation)
    assert raised.value.clause == report.NEVER_RULES_OUT[never][0] and f"never: {never}" in raised.value.detail


def test_certify_counts_the_clauses_a_manifest_rules_out_as_not_applicable() -> None:
    """CONF-CERT-1: KVC-FAIL-1 unexercised is a gap, unless the manifest declares that the connector never fails a
    load; KVC-FREE-1, not declared, stays one."""
    result = runner.RunResult(adapter="a", profile="ci", seed=None, passed=True, seconds=1.0, levels=("connector",))
    gaps = report.certification_gaps(report.build(result, "v", Capabilities(levels=("connector",))))
    ruled_out = report.build(result, "v", Capabilities(levels=("connector",), never=("fails_load",)))
    assert any(gap.startswith("KVC-FAIL-1") for gap in gaps)
    assert not any(gap.startswith("KVC-FAIL-1") for gap in report.certification_gaps(ruled_out))
    assert any(gap.startswith("KVC-FREE-1") for gap in report.certification_gaps(ruled_out))
    verdicts = {clause.id: clause for clause in ruled_out.clauses}
    fail_1 = verdicts["KVC-FAIL-1"]
    assert fail_1.verdict == "not applicable" and "never: fails_load" in (fail_1.not_applicable or "")
    assert verdicts["KVC-FREE-1"].verdict == "not exercised"
    assert ruled_out.run_time_coverage.not_applicable == 2, "KVC-FAIL-1, and CONF-OBS-2 of an unjudged level"
    assert 'message="not applicable: the manifest declares never: fails_load' in report.junit_xml(ruled_out)
    assert not any(gap.startswith("CONF-OBS-2") for gap in gaps), "BlockRefs are the offloading level's"
    both_levels = runner.RunResult(adapter="a", profile="ci", seed=None, passed=True, seconds=1.0,
                                   levels=("connector", "offloading"))
    assert any(gap.startswith("CONF-OBS-2") for gap in report.certification_gaps(
        report.build(both_levels, "v", Capabilities(never=("fails_load",)))))
