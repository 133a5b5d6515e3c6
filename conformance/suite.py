"""The conformance suite that `pytest --kv-adapter=…` runs: the state machine and the trace vectors."""

from __future__ import annotations

import pytest

from kvconform.conformance import runner, vectors
from kvconform.conformance.checks import ClauseViolation


def test_state_machine(kv_adapter_factory, pytestconfig: pytest.Config) -> None:
    """The adapter agrees with the reference on every drawn operation sequence."""
    result = runner.run(kv_adapter_factory, pytestconfig.getoption("kv_adapter") or "adapter",
                        pytestconfig.getoption("kv_profile"), pytestconfig.getoption("kv_seed"))
    if not result.passed:
        pytest.fail(f"[{result.failed_clause}] {result.message}\ncounterexample:\n{result.counterexample}",
                    pytrace=False)


@pytest.mark.parametrize("name", vectors.bundled())
def test_vector(kv_adapter_factory, name: str) -> None:
    """The adapter meets the expectations of a bundled trace vector."""
    try:
        vectors.replay(vectors.load(name), kv_adapter_factory())
    except ClauseViolation as violation:
        pytest.fail(str(violation), pytrace=False)
