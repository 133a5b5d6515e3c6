"""Every clause the kit checks at run time is shown to catch a broken implementation, deterministically.

`tests/kill_vectors.json` holds, per clause, a mutant of the catalogue and a short program (JSON operations,
as `kvconform replay` reads them) that the mutant fails with exactly that clause while the reference passes
it (the reference pair, for a mutant of the disaggregated level). The programs are counterexamples the kit itself
found and shrank, or, for the pair's, programs of `test_disaggregated_level.PROGRAMS`; when a change of the
reference moves one, find a new one with `kvconform run --adapter <the mutant's adapter> --profile dev --seed N
--report r.json` and take the report's `program`. Observation faults (`faulty_adapters.FAULTS`) cover the clauses no
implementation bug reaches first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faulty_adapters import FAULTS
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.reference_pd import ReferencePDAdapter
from kvconform.conformance.execution import Call, Session, replay
from kvconform.conformance.judging.levels import run_time_clauses
from kvconform.conformance.mutants import MUTANTS

KILL_VECTORS = json.loads(Path(__file__).with_name("kill_vectors.json").read_text())


@pytest.mark.parametrize("clause", sorted(KILL_VECTORS))
def test_mutant_fails_its_kill_vector_with_the_clause(clause: str) -> None:
    """The vector's mutant fails its program with exactly this clause; the reference passes the same program."""
    vector = KILL_VECTORS[clause]
    program = [Call.from_json(operation) for operation in vector["program"]]
    row = MUTANTS[vector["mutant"]]
    broken = replay(Session(row.adapter), program)
    assert broken.violation is not None and broken.violation.clause == clause, broken.violation
    reference = ReferencePDAdapter if "disaggregated" in row.levels else ReferenceAdapter
    assert replay(Session(reference), program).violation is None


def test_every_run_time_clause_catches_a_fault() -> None:
    """No clause is checked at run time without a mutant or a faulty adapter that it fails."""
    shown = set(KILL_VECTORS) | {clause for _, clause, _ in FAULTS.values()}
    unshown = run_time_clauses() - shown
    assert unshown == set(), f"checked but never shown to catch a fault: {unshown}"
