"""The conformance suite that `pytest --kv-adapter=…` runs: the state machine, and the bundled scenarios with those
given by `--kv-scenarios`."""

from __future__ import annotations

import pytest

from kvconform.conformance import options, scenarios
from kvconform.conformance.baseline import Baseline
from kvconform.conformance.execution import Session
from kvconform.conformance.machine import scheduling_modes
from kvconform.conformance.profiles import Shard
from kvconform.plugin import RUN_REPORT, SCENARIOS, keep_part_report, split_run_options


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "scenario" in metafunc.fixturenames:
        chosen = metafunc.config.stash.get(SCENARIOS, [])
        metafunc.parametrize("scenario", chosen, ids=[each.name for each in chosen])


def test_state_machine(kv_run_options: options.RunOptions, kv_shard: Shard, pytestconfig: pytest.Config) -> None:
    """The adapter agrees with the reference on every drawn operation sequence; writes the reports asked for.

    Under xdist, each part of the run leaves writing and certifying to the controller, which merges the parts'
    reports.
    """
    run_report = options.run(split_run_options(pytestconfig, kv_run_options), shard=kv_shard)
    merged_by_controller = keep_part_report(pytestconfig, kv_shard, run_report)
    if not merged_by_controller:
        pytestconfig.stash[RUN_REPORT] = run_report
        try:
            options.write_reports(run_report, kv_run_options.report_path, kv_run_options.junit_path)
        except options.UsageProblem as problem:
            pytest.fail(str(problem), pytrace=False)
    if not run_report.passed:
        traceback = f"\nadapter traceback:\n{run_report.adapter_traceback}" if run_report.adapter_traceback else ""
        pytest.fail(f"[{run_report.failed_clause}] {run_report.message}\ncounterexample:\n"
                    f"{run_report.counterexample}{traceback}", pytrace=False)
    gaps = [] if merged_by_controller else options.certification_gaps(kv_run_options, run_report)
    if gaps:
        pytest.fail("not certified:\n" + "\n".join(gaps), pytrace=False)


def test_scenario(kv_run_options: options.RunOptions, scenario: scenarios.Scenario) -> None:
    """The adapter meets a scenario, run as `kvconform replay` runs it (`scenarios.judge`); a known failure's clause is
    an xfail, and a scenario needing what the adapter lacks, or a scheduling mode the run does not draw, is skipped
    with the reason."""
    if scenario.config.async_scheduling not in scheduling_modes(kv_run_options.capabilities, kv_run_options.scheduling):
        pytest.skip(f"{scenario.name} uses {'async' if scenario.config.async_scheduling else 'sync'} scheduling, which "
                    f"this run does not draw (--kv-scheduling {kv_run_options.scheduling} and the adapter's "
                    f"capabilities)")
    try:
        verdict = scenarios.judge(scenario, Session(kv_run_options.factory, kv_run_options.call_timeout,
                                                    baseline=Baseline(list(kv_run_options.known_entries))))
    except scenarios.ScenarioError as error:
        pytest.fail(str(error), pytrace=False)
    if verdict.outcome == "refused":
        pytest.skip(verdict.detail)
    if verdict.outcome == "pass":
        return
    if verdict.outcome == "known failure" and verdict.clause is not None:
        pytest.xfail(f"known failure {verdict.clause}: {kv_run_options.known_failures[verdict.clause]}")
    traceback = f"\nadapter traceback:\n{verdict.adapter_traceback}" if verdict.adapter_traceback else ""
    pytest.fail(f"[{verdict.clause}] {verdict.detail}{traceback}", pytrace=False)
