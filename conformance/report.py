"""The machine-readable run report (JSON, pydantic) and the per-clause verdicts."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal
from xml.etree import ElementTree

from pydantic import BaseModel, Field

from kvconform.common.values import Capabilities, SpecLevel
from kvconform.common.version import KIT_VERSION
from kvconform.conformance import exercise
from kvconform.conformance.execution import RunStatistics, Scheduling
from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.conformance.runner import Outcome, RunResult
from kvconform.spec import registry

Verdict = Literal["pass", "fail", "not exercised", "not applicable", "known failure", "model-only"]


class ClauseResult(BaseModel):
    """The verdict of one clause in one run."""

    id: str = Field(description="the clause ID, e.g. OFF-READ-1")
    requirement: str = Field(description="its RFC 2119 keyword: MUST, MUST NOT, SHOULD or MAY")
    spec_level: SpecLevel | None = Field(description="the spec level it belongs to; None for the rules of judging, "
                                                     "which hold at every level")
    chapter: str = Field(description="the spec chapter file that defines it")
    verdict: Verdict
    exercised: int = Field(description="times a check compared an observation under this clause")
    checked_at_run_time: bool = Field(description="a registered check judges it against the adapter at run time")
    model_only: str | None = Field(None, description="why no run-time check can judge it (the spec's `Model-only:` "
                                                     "line): it is tested on the reference alone")
    known_failure: str | None = Field(None, description="the first failure seen, for a known failure")
    not_applicable: str | None = Field(None, description="why nothing this adapter does can exercise it, for a clause "
                                                         "not applicable (`not_applicable`, CONF-CERT-1)")


class RunTimeCoverage(BaseModel):
    """Run-time coverage: of the MUST and MUST NOT clauses that count for the run — those of the spec levels it
    judged, and the rules of judging — how many a check judges at run time, and how those fared."""

    must_clauses: int = Field(description="MUST and MUST NOT clauses of the judged levels and the rules of judging")
    judged_at_run_time: int = Field(description="of them, those a registered check judges against the adapter")
    passed: int = Field(description="judged at run time, exercised, and never broken")
    failed: int = Field(description="judged at run time and broken: the run's failed clause")
    known_failures: int = Field(description="judged at run time and listed as known failures")
    not_exercised: int = Field(description="judged at run time, but nothing in this run reached them")
    not_applicable: int = Field(0, description="judged at run time, but nothing this adapter does can reach them: "
                                               "ruled out by its manifest, or binding a level the run did not judge")
    model_only: int = Field(description="no run-time check can judge them: tested on the reference alone")

    def summary(self) -> str:
        """Return the coverage as one line, as the CLI and the pytest plugin print it."""
        share = f" ({self.judged_at_run_time / self.must_clauses:.0%})" if self.must_clauses else ""
        return (f"{self.judged_at_run_time}/{self.must_clauses} MUST clauses judged at run time{share}: "
                f"{self.passed} passed, {self.failed} failed, {self.known_failures} known failures, "
                f"{self.not_exercised} not exercised, {self.not_applicable} not applicable; {self.model_only} "
                "model-only")


class ShardResult(BaseModel):
    """One part of a run split across workers (`pytest -n`, `kvconform run --workers`): its seed and what it found."""

    index: int = Field(description="the part, counted from 0")
    seed: int | None = Field(description="the seed it drew its programs from")
    statistics: RunStatistics = Field(description="what it counted")
    seconds: float
    outcome: Outcome
    failed_clause: str | None


class RunReport(BaseModel):
    """One conformance run of one adapter."""

    kvconform_version: str = Field(description="the kvconform that ran")
    spec_version: str = Field(description="the SemVer version of the spec the run judged by (spec/CHANGELOG.md)")
    adapter: str = Field(description="the adapter as named on the command line: registered name or module:factory")
    implementation_version: str = Field(description="what the adapter's implementation_version() returned")
    capabilities: Capabilities = Field(description="what the adapter's capabilities() returned (CONF-CAP-1)")
    behaviours: list[str] = Field([], description="what the adapter's behaviours() returned: the behaviours, among "
                                                  "those the implementation's releases differ in, found in the code it "
                                                  "drives, each 'name: where the code shows it'")
    known_failures_files: list[str] = Field([], description="the known-failures files the run used, in order: the "
                                                            "implementation's shipped file, then the user's")
    profile: str = Field(description="the Hypothesis profile: ci, dev or thorough")
    seed: int | None = Field(description="the --seed given, or None")
    scheduling: Scheduling = Field(description="the scheduling modes drawn from")
    findings: dict[str, str] = Field({}, description="clause -> a fault of the connector's own answer that this "
                                                     "release's scheduler masked (replaced the answer before using "
                                                     "it): not a failure here, a failure on releases that take the "
                                                     "answer as given")
    drain_timeout: float | None = Field(None, description="seconds a drain waited at most for a connector on its own "
                                                          "clock to go idle (--drain-timeout); None where the harness "
                                                          "completes the adapter's transfers")
    levels: list[SpecLevel] = Field(description="the spec levels the run judged: the connector level on the adapter's "
                                                "own schedule, the offloading level against the reference engine, "
                                                "or the disaggregated level alone for a producer/consumer pair")
    certified_levels: list[SpecLevel] = Field(description="the judged levels at which every run-time MUST clause "
                                                          "passed, with no failure and no known failure (CONF-CERT-1)")
    passed: bool = Field(description="no failure: no clause broken beyond the known failures, none stale, no hang")
    outcome: Outcome = Field(description="ok, fail, or info: unknown, an adapter call never returned (CONF-CALL-2)")
    seconds: float = Field(description="wall-clock duration of the run")
    found_after: float | None = Field(None, description="seconds until the first failing program was found, before "
                                                        "shrinking; None when the run found none")
    statistics: RunStatistics = Field(default_factory=RunStatistics, description="what the run counted: examples, "
                                                                                "rules, steps, and where its time went")
    failed_clause: str | None = Field(description="the clause the run failed on")
    message: str | None = Field(description="what was wrong, naming the adapter call that gave it")
    counterexample: str | None = Field(description="the shrunk program of adapter calls that fails, as Python")
    program: list[dict] | None = Field(None, description="the same program as JSON operations, for `kvconform replay`")
    adapter_traceback: str | None = Field(description="the adapter's traceback, when it raised (CONF-CALL-1)")
    known_failures: dict[str, str] = Field(description="clause -> reason, from the known-failures files")
    known_failures_met: dict[str, int] = Field({}, description="every listed known-failure entry (its clause, and "
                                                               "its /cause/ if any) -> how many failures it covered")
    exercise: dict[str, dict[str, int]] = Field({}, description="scheduling mode -> situation -> how often the run "
                                                                "drew it (conformance.exercise.SITUATIONS)")
    never_drawn: list[str] = Field([], description="'mode: situation' for each situation the adapter supports that "
                                                   "the run never drew in a mode it ran: a gap in the kit's strategies")
    run_time_coverage: RunTimeCoverage = Field(description="how many of the MUST clauses that count were judged at "
                                                           "run time, and how those fared")
    clauses: list[ClauseResult] = Field(description="one verdict per clause of the spec")
    shards: list[ShardResult] = Field([], description="the parts of a run split across workers, each drawn from its "
                                                      "own seed; empty for a run in one process")


def build(result: RunResult, implementation_version: str, capabilities: Capabilities,
          known_failures: dict[str, str] | None = None, behaviours: list[str] | None = None,
          known_failures_files: list[str] | None = None) -> RunReport:
    """Return the report of a run: a verdict for every clause of the spec."""
    clauses = _verdicts(result.coverage, result.failed_clause, result.known_failures,
                        not_applicable(capabilities, result.levels))
    run_report = RunReport(
        kvconform_version=KIT_VERSION, spec_version=registry.spec_version(), adapter=result.adapter,
        implementation_version=implementation_version, capabilities=capabilities, behaviours=behaviours or [],
        known_failures_files=known_failures_files or [], profile=result.profile, seed=result.seed,
        scheduling=result.scheduling, levels=list(result.levels), certified_levels=[],
        drain_timeout=None if capabilities.harness_completes_transfers else result.drain_timeout,
        findings=dict(result.findings),
        passed=result.passed, outcome=result.outcome,
        seconds=round(result.seconds, 3),
        found_after=None if result.found_after is None else round(result.found_after, 3), statistics=result.statistics,
        failed_clause=result.failed_clause, message=result.message, counterexample=result.counterexample,
        program=result.program, adapter_traceback=result.adapter_traceback, known_failures=known_failures or {},
        known_failures_met=result.known_failures_met, exercise=result.exercise,
        never_drawn=exercise.never_drawn(result.exercise, capabilities),
        run_time_coverage=run_time_coverage(clauses, result.levels), clauses=clauses,
    )
    run_report.certified_levels = [level for level in run_report.levels if not certification_gaps(run_report, level)]
    return run_report


def counted(clauses: list[ClauseResult], levels: Iterable[SpecLevel]) -> list[ClauseResult]:
    """Return the clauses that count for a run judging `levels`: theirs, and the rules of judging (CONF-CERT-1)."""
    levels = set(levels)
    return [c for c in clauses if c.spec_level is None or c.spec_level in levels]


def run_time_coverage(clauses: list[ClauseResult], levels: Iterable[SpecLevel]) -> RunTimeCoverage:
    """Return the run-time coverage of the MUST and MUST NOT clauses that count for a run judging `levels`."""
    must = [c for c in counted(clauses, levels) if c.requirement.startswith("MUST")]
    judged = [c.verdict for c in must if c.checked_at_run_time]
    return RunTimeCoverage(must_clauses=len(must), judged_at_run_time=len(judged), passed=judged.count("pass"),
                           failed=judged.count("fail"), known_failures=judged.count("known failure"),
                           not_exercised=judged.count("not exercised"),
                           not_applicable=judged.count("not applicable"), model_only=len(must) - len(judged))


def _verdicts(coverage: dict[str, int], failed_clause: str | None, seen_known_failures: Mapping[str, str | None],
              ruled_out: Mapping[str, str]) -> list[ClauseResult]:
    """Return a verdict for every clause of the spec, from how often each was exercised, what failed, and what the
    adapter cannot exercise (`ruled_out`: clause -> why)."""
    runtime_checked = run_time_clauses()
    clauses = []
    for clause in registry.clauses().values():
        count = coverage.get(clause.id, 0)
        verdict: Verdict = ("fail" if clause.id == failed_clause else
                            "known failure" if clause.id in seen_known_failures else
                            "model-only" if clause.model_only else
                            "pass" if count else
                            "not applicable" if clause.id in ruled_out else "not exercised")
        clauses.append(ClauseResult(id=clause.id, requirement=clause.requirement, spec_level=clause.spec_level,
                                    chapter=clause.chapter, verdict=verdict,
                                    exercised=count, checked_at_run_time=clause.id in runtime_checked,
                                    model_only=clause.model_only, known_failure=seen_known_failures.get(clause.id),
                                    not_applicable=ruled_out.get(clause.id) if verdict == "not applicable" else None))
    return clauses


def merge(parts: list[RunReport], seed: int | None, rare_known_failures: frozenset[str] = frozenset()) -> RunReport:
    """Return the report of a run split across workers from the reports of its parts, in shard order.

    The run fails as its first failing part does (a clause failure before a hang); a known-failure entry is stale
    only when no part met it and it is not among the `rare_known_failures` (entry names) (CONF-RUN-2); clauses are
    exercised, and entries met, as often as all parts did together.
    """
    first = parts[0]
    failing = next((part for part in parts if part.outcome == "fail"),
                   next((part for part in parts if part.outcome == "info"), None))
    seen = {c.id: c.known_failure for part in parts for c in part.clauses if c.verdict == "known failure"}
    met = {name: sum(part.known_failures_met.get(name, 0) for part in parts) for name in first.known_failures_met}
    stale = [name for name, count in met.items() if not count and name not in rare_known_failures]
    coverage = {c.id: sum(part.clauses[i].exercised for part in parts) for i, c in enumerate(first.clauses)}
    drawn = exercise.added(part.exercise for part in parts)
    failure: dict[str, Any] = dict(failed_clause=None, message=None, counterexample=None, program=None,
                                   adapter_traceback=None, found_after=None)
    if failing is not None:
        failure = {name: getattr(failing, name) for name in failure}
    elif stale:
        failure.update(failed_clause="CONF-RUN-2",
                       message=f"known failures that no longer fail (stale baseline entries): {', '.join(stale)}")
    clauses = _verdicts(coverage, failure["failed_clause"], seen, not_applicable(first.capabilities, first.levels))
    statistics = sum((part.statistics for part in parts if part is not failing),  # found in the failing part
                     RunStatistics() if failing is None else failing.statistics)
    run_report = first.model_copy(update=dict(
        seed=seed, passed=failure["failed_clause"] is None,
        outcome=failing.outcome if failing else "ok" if failure["failed_clause"] is None else "fail",
        seconds=max(part.seconds for part in parts), statistics=statistics, known_failures_met=met,
        **failure,
        findings={clause: finding for part in reversed(parts) for clause, finding in part.findings.items()},
        exercise=drawn, never_drawn=exercise.never_drawn(drawn, first.capabilities),
        clauses=clauses, run_time_coverage=run_time_coverage(clauses, first.levels),
        shards=[ShardResult(index=index, seed=part.seed, statistics=part.statistics, seconds=part.seconds,
                            outcome=part.outcome, failed_clause=part.failed_clause)
                for index, part in enumerate(parts)]))
    run_report.certified_levels = [level for level in run_report.levels if not certification_gaps(run_report, level)]
    return run_report


def certification_gaps(run_report: RunReport, level: SpecLevel | None = None) -> list[str]:
    """Return why the run does not certify the adapter at `level` (default: at every level it judged); empty when it
    does (CONF-CERT-1). Only the clauses of that level, and the rules of judging, count."""
    judged = counted(run_report.clauses, run_report.levels if level is None else [level])
    gaps = [] if run_report.passed else [f"the run failed: {run_report.failed_clause}"]
    judged_ids = {c.id for c in judged}
    gaps += [f"{clause}: known failure ({reason})" for clause, reason in sorted(run_report.known_failures.items())
             if clause in judged_ids]
    gaps += [f"{c.id} ({c.requirement}) was not exercised" for c in judged
             if c.requirement.startswith("MUST") and c.checked_at_run_time and c.verdict == "not exercised"]
    return gaps


NEVER_RULES_OUT: dict[str, tuple[str, ...]] = {"delays_free": ("KVC-FREE-1",), "fails_load": ("KVC-FAIL-1",)}
"""What a connector's design never does (`Capabilities.never`, its manifest) -> the clauses that can then never be
exercised for it; the judge fails the clause if the connector does it after all (KVC-FREE-1, KVC-FAIL-1)."""


READS_KV_CLAUSES = ("KVC-DATA-1", "XFER-DATA-1", "PD-DATA-1")
"""The clauses judged on the GPU bytes `computed_kv()` returns: not applicable where the adapter cannot return them
(`Capabilities.reads_kv` False, as a recorded engine, whose model's KV is not in its trace)."""

LEVEL_ABSENT: dict[str | None, str] = {"events": "the adapter reports no KV events: its capabilities' levels lack "
                                                  "'events' (chapter kv-events)"}
"""Why a level's clauses are not applicable to an adapter that does not report it, where more is to say than that."""


LEVEL_RULES: dict[str, SpecLevel] = {"CONF-OBS-2": "offloading"}
"""Rules of judging (chapter 07) that bind only one level's observations: BlockRefs name offloaded blocks, which only
an adapter judged at the offloading level reports (CONF-OBS-2)."""


def not_applicable(capabilities: Capabilities, levels: Iterable[SpecLevel]) -> dict[str, str]:
    """Return the clauses that cannot be exercised for this adapter, each with why: those of the levels the run did not
    judge, those its manifest rules out (what it never does) and the rules of judging of a level the run did not
    judge. Their verdict, unexercised, is "not applicable", which certifying does not require (CONF-CERT-1)."""
    judged = set(levels)
    return ({clause.id: (LEVEL_ABSENT[clause.spec_level] if clause.spec_level in LEVEL_ABSENT else
                         f"a clause of the {clause.spec_level} level, which this run did not judge")
             for clause in registry.clauses().values() if clause.spec_level not in (None, *judged)}
            | {clause: f"the manifest declares never: {never}, which the judge verifies"
               for never in capabilities.never for clause in NEVER_RULES_OUT[never]}
            | {clause: "the adapter cannot read its GPU bytes (reads_kv False): their integrity is not judged"
               for clause in READS_KV_CLAUSES if not capabilities.reads_kv}
            | {clause: f"binds only the {level} level's observations, not judged in this run"
               for clause, level in LEVEL_RULES.items() if level not in judged})


def junit_xml(run_report: RunReport) -> str:
    """Return the report as JUnit XML: one test case per clause, as GitHub, GitLab and Jenkins render it."""
    verdicts = [c.verdict for c in run_report.clauses]
    suite = ElementTree.Element("testsuite", name=f"kvconform {run_report.adapter}", tests=str(len(verdicts)),
                                failures=str(verdicts.count("fail")), errors="0",
                                skipped=str(len(verdicts) - verdicts.count("pass") - verdicts.count("fail")),
                                time=f"{run_report.seconds:.3f}")
    properties = ElementTree.SubElement(suite, "properties")
    for name in ("kvconform_version", "spec_version", "adapter", "implementation_version", "profile", "seed",
                 "scheduling", "levels", "certified_levels", "outcome"):
        ElementTree.SubElement(properties, "property", name=name, value=str(getattr(run_report, name)))
    ElementTree.SubElement(properties, "property", name="run_time_coverage",
                           value=run_report.run_time_coverage.summary())
    for clause in run_report.clauses:
        case = ElementTree.SubElement(suite, "testcase", classname=f"kvconform.{clause.chapter.removesuffix('.md')}",
                                      name=f"{clause.id} ({clause.requirement})")
        if clause.verdict == "fail":
            failure = ElementTree.SubElement(case, "failure", message=run_report.message or "", type=clause.id)
            failure.text = run_report.counterexample or ""
        elif clause.verdict == "known failure":
            ElementTree.SubElement(case, "skipped", message=f"known failure: {run_report.known_failures[clause.id]}")
        elif clause.verdict == "not exercised":
            ElementTree.SubElement(case, "skipped", message="not exercised by this run")
        elif clause.verdict == "not applicable":
            ElementTree.SubElement(case, "skipped", message=f"not applicable: {clause.not_applicable}")
        elif clause.verdict == "model-only":
            ElementTree.SubElement(case, "skipped", message=f"model-only: {clause.model_only}")
    root = ElementTree.Element("testsuites")
    root.append(suite)
    ElementTree.indent(root)
    return ElementTree.tostring(root, encoding="unicode", xml_declaration=True)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so no reader sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
