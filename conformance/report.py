"""The machine-readable run report (JSON, pydantic) and the per-clause verdicts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

import kvconform
from kvconform.adapters.contract import Capabilities
from kvconform.conformance.runner import Outcome, RunResult
from kvconform.spec import registry

Verdict = Literal["pass", "fail", "not exercised"]


class ClauseResult(BaseModel):
    id: str
    level: str
    verdict: Verdict
    exercised: int


class RunReport(BaseModel):
    """One conformance run of one adapter."""

    kvconform_version: str
    spec_version: str
    adapter: str
    implementation_version: str
    capabilities: Capabilities
    profile: str
    seed: int | None
    passed: bool
    outcome: Outcome
    seconds: float
    failed_clause: str | None
    message: str | None
    counterexample: str | None
    adapter_traceback: str | None
    clauses: list[ClauseResult]


def build(result: RunResult, implementation_version: str, capabilities: Capabilities) -> RunReport:
    """Return the report of a run: a verdict for every clause of the spec."""
    clauses = []
    for clause in registry.clauses().values():
        count = result.coverage.get(clause.id, 0)
        verdict: Verdict = "fail" if clause.id == result.failed_clause else "pass" if count else "not exercised"
        clauses.append(ClauseResult(id=clause.id, level=clause.level, verdict=verdict, exercised=count))
    return RunReport(
        kvconform_version=kvconform.__version__, spec_version=registry.spec_version(), adapter=result.adapter,
        implementation_version=implementation_version, capabilities=capabilities, profile=result.profile,
        seed=result.seed, passed=result.passed, outcome=result.outcome, seconds=round(result.seconds, 3),
        failed_clause=result.failed_clause, message=result.message, counterexample=result.counterexample,
        adapter_traceback=result.adapter_traceback, clauses=clauses,
    )


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
