"""The mutant catalogue as pytest tests, one per mutant, which the workers benchmark runs under pytest-xdist.

The profile and the mutants come from the environment (`PROFILE_VARIABLE`, `MUTANTS_VARIABLE`), as a
benchmark run sets them for the pytest process it starts.
"""

from __future__ import annotations

import os

import pytest

from kvconform.conformance.mutants import MUTANTS
from kvconform.conformance.mutants.kills import kill

PROFILE_VARIABLE = "KVCONFORM_CATALOGUE_PROFILE"
MUTANTS_VARIABLE = "KVCONFORM_CATALOGUE_MUTANTS"


@pytest.mark.parametrize("name", os.environ.get(MUTANTS_VARIABLE, ",".join(MUTANTS)).split(","))
def test_mutant_is_killed(name: str) -> None:
    """The kit kills the mutant with a clause its catalogue row names."""
    result = kill(name, os.environ.get(PROFILE_VARIABLE, "ci"), None)
    assert result.verdict == "killed", f"{name}: {result.verdict} ({result.failed_clause})"
