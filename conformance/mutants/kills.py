"""The kill-rate report: the kit against the reference and every mutant of the catalogue (`kvconform mutants`).

A mutant is killed when the run fails with one of the clauses its catalogue row names. A run that fails
with another clause found the mutant for a reason the catalogue does not explain, which is reported as
such; a run that passes lets the mutant survive: a clause claims to check something it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel, Field

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.common.version import KIT_VERSION
from kvconform.conformance import runner
from kvconform.conformance.mutants import MUTANTS
from kvconform.spec import registry

Verdict = Literal["killed", "killed by another clause", "survived"]


class Kill(BaseModel):
    """The kit's run against one mutant."""

    mutant: str
    vllm_ref: str = Field(description="the vLLM issue or PR whose bug the mutant puts back")
    clauses: list[str] = Field(description="the clauses that observe the bug; the first is the one it violates")
    verdict: Verdict
    failed_clause: str | None
    found_after: float | None = Field(description="seconds until the first failing program was found")
    seconds: float = Field(description="seconds until the run ended, the shrinking of the counterexample included")
    requests: int = Field(description="requests of the shrunk counterexample")
    calls: int = Field(description="adapter calls of the shrunk counterexample")
    message: str | None
    counterexample: str | None


class KillReport(BaseModel):
    """The kit against the reference adapter and a set of mutants, under one profile."""

    kvconform_version: str
    spec_version: str
    profile: str
    seed: int | None
    reference_passed: bool
    reference_failure: str | None
    kills: list[Kill]

    @property
    def passed(self) -> bool:
        """True when the reference passed and every mutant was killed for a reason its row names."""
        return self.reference_passed and all(kill.verdict == "killed" for kill in self.kills)


def kill(name: str, profile: str, seed: int | None) -> Kill:
    """Run the kit against mutant `name` and say whether it was killed."""
    row = MUTANTS[name]
    result = runner.run(row.adapter, name, profile, seed)
    verdict: Verdict = ("survived" if result.passed else
                        "killed" if result.failed_clause in row.clauses else "killed by another clause")
    return Kill(mutant=name, vllm_ref=row.vllm_ref, clauses=list(row.clauses), verdict=verdict,
                failed_clause=result.failed_clause, found_after=result.found_after, seconds=round(result.seconds, 3),
                requests=result.counterexample_requests, calls=len(result.counterexample_calls),
                message=result.message, counterexample=result.counterexample)


def kill_all(names: Iterable[str], profile: str, seed: int | None,
             on_kill: Callable[[Kill], None] = lambda kill: None) -> KillReport:
    """Run the kit against the reference, then against each named mutant, reporting each as it ends."""
    reference = runner.run(ReferenceAdapter, "reference", profile, seed)
    kills = []
    for name in names:
        kills.append(kill(name, profile, seed))
        on_kill(kills[-1])
    reference_failure = None if reference.passed else f"[{reference.failed_clause}] {reference.message}"
    return KillReport(kvconform_version=KIT_VERSION, spec_version=registry.spec_version(), profile=profile,
                      seed=seed, reference_passed=reference.passed, reference_failure=reference_failure, kills=kills)
