"""The suite `pytest --kv-adapter=… --kv-vllm=A,B` runs: one test per vLLM release, each running `kvconform run` in
that release's environment (`kvconform.releases`), as `kvconform run --vllm` does."""

from __future__ import annotations

import pytest

from kvconform.plugin import RELEASE_ROWS, RELEASES, release_arguments


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "release" in metafunc.fixturenames:
        chosen = metafunc.config.stash.get(RELEASES, [])
        metafunc.parametrize("release", chosen, ids=[f"vllm-{version}" for version in chosen])


def test_release(release: str, pytestconfig: pytest.Config) -> None:
    """The adapter passes on this release, in its own environment (built once when missing)."""
    from kvconform import releases

    try:
        env = releases.prepare(release, say=lambda line: None)
    except releases.ReleaseProblem as problem:
        pytest.fail(str(problem), pytrace=False)
    row = releases.run_release(release, env, release_arguments(pytestconfig), say=lambda line: None)
    pytestconfig.stash[RELEASE_ROWS].append(row)
    if not row.passed:
        counterexample = row.report.counterexample if row.report else None
        pytest.fail(releases.summary_line(row) + (f"\ncounterexample:\n{counterexample}" if counterexample else ""),
                    pytrace=False)
