"""Reports: JSON and JUnit, known failures (CONF-RUN-2) and certification (CONF-CERT-1)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from xml.etree import ElementTree

import pytest
from click.testing import CliRunner

from faulty_adapters import failing_reset
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.cli import main
from kvconform.common.values import Capabilities, EngineConfig, RequestSpec
from kvconform.conformance import baseline, exercise, runner
from kvconform.conformance.execution import Session, replay
from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.conformance.mutants import MUTANTS, black_box
from kvconform.conformance.operations import Call
from kvconform.conformance.report import RunReport, build
from kvconform.spec import registry


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", *args])
    return result.exit_code, result.stderr


def run_printing(*args: str) -> tuple[int, str]:
    """Return the exit code and what `kvconform run` printed on stdout: the coverage line and the clause table."""
    result = CliRunner().invoke(main, ["run", *args])
    return result.exit_code, result.stdout


def test_known_failure_is_reported_not_fatal() -> None:
    """CONF-RUN-2: the seed mutant's clause listed as known: reported as a known failure, and the examples it
    ends report none of its consequences, so the run passes."""
    known = baseline.Baseline([baseline.Entry("OFF-READ-1", "the seed bug, vLLM PR #44592")])
    result = runner.run(MUTANTS["skip-flag-ignored"].adapter, "skip-flag-ignored", "smoke", baseline=known)
    assert "OFF-READ-1" in result.known_failures, result.message
    assert result.passed, result.message


@pytest.mark.parametrize("recovered", [True, False])
def test_implementation_failure_is_reported_under_its_clause(recovered: bool) -> None:
    """CONF-CALL-1: an implementation failure an adapter reports is a failure of its clause, naming the call."""
    result = runner.run(failing_reset(recovered), "failing-reset", "ci")
    assert (result.passed, result.failed_clause) == (False, "OFF-MGR-8"), result.message
    assert "adapter.reset_prefix_cache(True): the implementation failed" in result.message


def test_known_implementation_failure_goes_on_if_recovered() -> None:
    """CONF-RUN-2: a known implementation failure does not fail the run; a recovered one lets its example go on,
    an unrecovered one ends it."""
    for recovered in (True, False):
        adapter = failing_reset(recovered)
        known = baseline.Baseline([baseline.Entry("OFF-MGR-8", "the connector reset fails")])
        result = runner.run(adapter, "failing-reset", "smoke", baseline=known)
        assert result.passed and "OFF-MGR-8" in result.known_failures, result.message
        assert (adapter.steps_after_failure > 0) is recovered, adapter.steps_after_failure


def test_a_failed_connector_reset_leaves_the_reference_store_too() -> None:
    """CONF-RUN-2, OFF-MGR-8: after a known connector reset that the implementation failed and recovered from, its
    store still holds what it stored, and the reference keeps its own: the same prompt again is a hit on both (vLLM
    0.30.0 ci: the reference forgot a request aborted before a failed second reset, which vLLM offered at finish)."""
    prompt = (1, 2, 3, 0) * 6
    program = [Call("start", (EngineConfig(block_size_factor=1, num_offload_blocks=32),)),
               Call("add_request", (RequestSpec(request_id="r0", prompt=prompt),)), Call("drain"),
               Call("reset_prefix_cache", (True,)), Call("add_request", (RequestSpec(request_id="r1", prompt=prompt),)),
               Call("drain")]
    known = baseline.Baseline([baseline.Entry("OFF-MGR-8", "the connector reset fails")])
    session = Session(failing_reset(recovered=True), baseline=known)
    assert replay(session, program).violation is None
    assert known.met["OFF-MGR-8"] == 1, known.met


def test_stale_known_failure_fails_the_run() -> None:
    """CONF-RUN-2: a listed clause that never fails makes the run fail as stale."""
    result = runner.run(MUTANTS["skip-flag-ignored"].adapter.__mro__[1], "reference", "smoke",
                        baseline=baseline.Baseline([baseline.Entry("OFF-READ-1", "no longer true")]))
    assert (result.passed, result.failed_clause) == (False, "CONF-RUN-2") and "OFF-READ-1" in result.message


def test_rare_known_failure_is_not_stale(tmp_path: Path) -> None:
    """CONF-RUN-2: a listed clause marked rare that never fails does not fail the run; unmarked entries still do."""
    path = tmp_path / "known.txt"
    path.write_text("OFF-READ-1 [rare]: only some programs reach it\nOFF-LRU-1: always\n")
    known = baseline.load(path)
    assert (known.entries.keys(), known.rare, known.stale()) == ({"OFF-READ-1", "OFF-LRU-1"}, {"OFF-READ-1"},
                                                                 ["OFF-LRU-1"])
    result = runner.run(MUTANTS["skip-flag-ignored"].adapter.__mro__[1], "reference", "smoke",
                        baseline=baseline.Baseline([baseline.Entry("OFF-READ-1", "rare", rare=True)]))
    assert result.passed, result.message


@pytest.mark.parametrize("text, message", [
    ("OFF-READ-1\n", "expected 'CLAUSE-ID: reason'"),
    ("NOPE-1: reason\n", "NOPE-1 is not a clause"),
    ("OFF-READ-1:   \n", "expected 'CLAUSE-ID: reason'"),
])
def test_bad_known_failures_file_is_exit_2(tmp_path: Path, text: str, message: str) -> None:
    """A malformed known-failures file is one line and exit 2."""
    path = tmp_path / "known.txt"
    path.write_text(f"# comment\n\n{text}")
    code, stderr = run("--known-failures", str(path))
    assert code == 2 and message in stderr, stderr
    code, stderr = run("--known-failures", str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read" in stderr


def test_reports_are_json_and_junit(tmp_path: Path) -> None:
    """The reports: JSON with the spec version; JUnit with one case per clause, every clause the run did not pass
    skipped with why (a model-only one with its reason); the printed coverage line is the report's."""
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    code, stdout = run_printing("--profile", "smoke", "--report", str(report), "--junit", str(junit))
    assert code == 0, stdout
    written = json.loads(report.read_text())
    assert written["spec_version"] == registry.spec_version() and written["outcome"] == "ok"
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(registry.clauses()) == int(suite.get("tests"))
    assert int(suite.get("failures")) == 0
    assert {c.get("name").split()[0] for c in cases} == set(registry.clauses())
    skipped = {c.get("name").split()[0]: c.find("skipped").get("message")
               for c in cases if c.find("skipped") is not None}
    verdicts = {c["id"]: c["verdict"] for c in written["clauses"]}
    assert set(skipped) == {clause for clause, verdict in verdicts.items() if verdict != "pass"}
    for clause, message in skipped.items():
        reason = registry.clauses()[clause].model_only
        level = registry.clauses()[clause].spec_level
        assert message == (f"model-only: {reason}" if reason else
                           f"not applicable: a clause of the {level} level, which this run did not judge"
                           if level not in (None, *written["levels"]) else "not exercised by this run"), clause
    coverage = RunReport.model_validate(written).run_time_coverage
    assert stdout.startswith(f"kvconform spec {registry.spec_version()}: reference: {coverage.summary()}\n"), stdout


@pytest.mark.long
def test_ci_draws_every_situation_and_certifies_the_reference(tmp_path: Path) -> None:
    """CONF-CAP-1 and CONF-CERT-1: the ci profile draws every situation the reference supports in both modes (the
    exercise table); the reference certifies, and the table lists no clause: none failed, is known or went
    unexercised."""
    report = tmp_path / "r.json"
    code, stdout = run_printing("--report", str(report), "--certify")
    assert code == 0, stdout
    written = json.loads(report.read_text())
    assert not any(clause in stdout for clause in registry.clauses()), stdout
    assert sorted(written["exercise"]) == ["async", "sync"], written["exercise"]
    assert written["never_drawn"] == [], written["exercise"]
    assert all(count > 0 for counts in written["exercise"].values() for count in counts.values()), written["exercise"]
    assert "situations drawn" in stdout and "never drawn" not in stdout, stdout


def test_a_supported_situation_never_drawn_is_named() -> None:
    """CONF-CAP-1: the exercise table counts a call as the situation its engine state makes it, adds up the parts of a
    split run, and names each situation the adapter supports that a mode never drew, not those it does not support."""
    class Loading:
        def loading(self) -> list[str]:
            return ["r1"]

        def storing(self) -> list[str]:
            return []

        def stores_in_flight(self) -> bool:
            return False

        def transfers_pending(self) -> bool:
            return True

    table: exercise.Table = {}
    exercise.note(table, "sync", Call("abort", ("r1",)), Loading())
    exercise.note(table, "sync", Call("abort", ("r2",)), Loading())
    assert table["sync"]["abort during a load"] == 1
    total = exercise.added([table, table])
    assert total["sync"]["abort during a load"] == 2
    gaps = exercise.never_drawn(total, Capabilities(transfer_failures=False, complete_in_step=True))
    assert "sync: transfers completed inside a step" in gaps and "sync: abort during a load" not in gaps
    assert not any("failed" in gap for gap in gaps)


def test_run_time_coverage_counts_the_must_clauses_of_the_judged_levels() -> None:
    """The run-time coverage: the MUST clauses of the judged levels and the rules of judging, split into those judged at
    run time (by verdict) and the model-only ones; a connector-level adapter counts only its level's."""
    for adapter, levels in ((ReferenceAdapter, {"connector", "offloading", "events"}),
                            (black_box(ReferenceAdapter), {"connector"})):
        result = runner.run(adapter, "reference", "smoke")
        coverage = build(result, "x", Capabilities()).run_time_coverage
        must = [c for c in registry.clauses().values()
                if c.requirement.startswith("MUST") and (c.spec_level is None or c.spec_level in levels)]
        judged = [c for c in must if c.id in run_time_clauses()]
        assert (coverage.must_clauses, coverage.judged_at_run_time, coverage.model_only) == (
            len(must), len(judged), len(must) - len(judged)), (levels, coverage)
        assert coverage.passed + coverage.not_exercised + coverage.not_applicable == len(judged), coverage
        assert coverage.failed == 0 and coverage.not_applicable == (levels == {"connector"}), "CONF-OBS-2 of one level"


def test_table_lists_the_rows_that_matter_and_every_clause_when_verbose() -> None:
    """Without --verbose the table lists the failed clause and none that passed; with it, every clause of the judged
    levels."""
    code, stdout = run_printing("--adapter", "kvconform_test_mutant:make", "--scheduling", "sync")
    assert code == 1 and re.search(r"│ OFF-READ-1 +│ MUST NOT +│ offloading +│ fail ", stdout), stdout
    assert not re.search(r"│ (pass|model-only) +│", stdout), stdout
    assert "(--verbose lists every clause)" in stdout
    code, stdout = run_printing("--profile", "smoke", "--verbose")
    judged = [c.id for c in registry.clauses().values() if c.spec_level in (None, "connector", "offloading")]
    assert code == 0 and all(f"│ {clause} " in stdout for clause in judged), stdout


def test_certify_names_every_gap(tmp_path: Path) -> None:
    """CONF-CERT-1: a known failure blocks certification even though the run passes."""
    known = tmp_path / "known.txt"
    known.write_text("OFF-READ-1: the seed bug\n")
    code, stderr = run("--adapter", "kvconform_test_mutant:make", "--known-failures", str(known), "--certify",
                       "--profile", "smoke")
    assert code == 1 and "not certified: OFF-READ-1: known failure" in stderr, stderr


PRINTED_COUNTEREXAMPLES = {"connector": "negative-answer", "offloading": "skip-flag-ignored",
                           "disaggregated": "pd-receive-reported-twice"}
"""Per spec level, a mutant killed at it (a KVC-* clause, the seed bug, a P/D clause) whose smoke-profile
counterexample is printed and run again."""


@pytest.mark.parametrize("level", sorted(PRINTED_COUNTEREXAMPLES))
def test_a_printed_counterexample_is_python_that_runs_against_the_adapter(level: str) -> None:
    """The counterexample a run prints is a snippet that runs against a freshly built adapter, every call accepted
    (a TypeError is a call the adapter does not take); its program, replayed by the kit, fails the same clause."""
    name = PRINTED_COUNTEREXAMPLES[level]
    row = MUTANTS[name]
    result = runner.run(row.adapter, name, "smoke")
    assert result.failed_clause in row.clauses and level in (*row.levels, "connector"), result.message
    assert result.counterexample.startswith("# adapter: "), result.counterexample
    if level == "disaggregated":
        assert "adapter.prefill(RequestSpec(" in result.counterexample
        assert "adapter.decode(RequestSpec(" in result.counterexample, result.counterexample
    adapter = row.adapter()
    try:
        exec(result.counterexample, {"adapter": adapter})
    finally:
        adapter.close()
    replayed = replay(Session(row.adapter), result.counterexample_calls)
    assert replayed.violation is not None and replayed.violation.clause == result.failed_clause, replayed.violation
    assert result.counterexample_requests == sum(call.operation in ("add_request", "prefill", "decode")
                                                 for call in result.counterexample_calls) > 0


def test_replay_runs_a_reported_counterexample_again(tmp_path: Path) -> None:
    """`kvconform replay` reruns the program of a report: it fails the mutant again and passes the reference."""
    report = tmp_path / "seed.json"
    code, _ = run("--adapter", "kvconform_test_mutant:make", "--report", str(report))
    assert code == 1 and json.loads(report.read_text())["program"]
    replayed = CliRunner().invoke(main, ["replay", str(report), "--adapter", "kvconform_test_mutant:make"])
    assert replayed.exit_code == 1 and "NOT conformant: OFF-READ-1" in replayed.stdout, replayed.stdout
    assert "from kvconform.common.values import" in replayed.stdout
    assert "adapter.add_request(RequestSpec(" in replayed.stdout
    assert CliRunner().invoke(main, ["replay", str(report)]).exit_code == 0
    bad = tmp_path / "bad.json"
    bad.write_text('[{"op": "jump"}]')
    refused = CliRunner().invoke(main, ["replay", str(bad)])
    assert refused.exit_code == 2 and "'op' must be one of" in refused.stderr
