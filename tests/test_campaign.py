"""Long campaigns: runs split across pytest-xdist workers, merged reports, and the example database (CONF-RUN-4/5)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from kvconform.common.values import Capabilities
from kvconform.conformance import examples, report, runner
from kvconform.conformance.execution import RunStatistics
from kvconform.conformance.mutants import MUTANTS
from kvconform.conformance.profiles import Shard
from kvconform.spec import registry

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
MUTANT = "kvconform_test_mutant:make"
"""The seed bug (vLLM #44585), found at example 3 – 15 of a smoke run (30 seeds measured): the runs that must find it
in each part of a split run take the ci profile's 150 examples per part, a margin whatever programs the Hypothesis
release draws."""


@pytest.fixture
def xdist_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose runs start xdist workers that import the adapters of the test tree."""
    pytest.importorskip("xdist", reason="needs pytest-xdist: pip install -e '.[xdist]'")
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    return pytester


def run_split(pytester: pytest.Pytester, *options: str) -> tuple[pytest.RunResult, dict]:
    """Run the suite's state machine in two xdist workers; return pytest's result and the merged JSON report."""
    path = pytester.path / f"run-{time.monotonic_ns()}.json"
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "-k", "test_state_machine",
                                           f"--kv-report={path}", *options)
    return result, json.loads(path.read_text())


@pytest.mark.long
def test_split_run_is_merged_into_one_report(xdist_pytester: pytest.Pytester) -> None:
    """CONF-RUN-4: each worker runs one part of the examples from its own seed, the same on a rerun; the controller
    writes one JSON and one JUnit report for the whole run."""
    junit = xdist_pytester.path / "run.xml"
    result, merged = run_split(xdist_pytester, "--kv-adapter=reference", "--kv-profile=smoke", f"--kv-junit={junit}")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["merged from 2 parts drawn from seed 0: seed 0 ok *, seed 1 ok *"])
    assert (merged["outcome"], merged["seed"], [part["seed"] for part in merged["shards"]]) == ("ok", 0, [0, 1])
    assert merged["statistics"]["examples"] == sum(part["statistics"]["examples"] for part in merged["shards"])
    assert merged["statistics"]["rules"] == sum(part["statistics"]["rules"] for part in merged["shards"])
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    assert sorted(case.get("name").split()[0] for case in cases) == sorted(registry.clauses())
    _, again = run_split(xdist_pytester, "--kv-adapter=reference", "--kv-profile=smoke")
    assert [(part["statistics"]["rules"], part["statistics"]["steps"]) for part in again["shards"]] == \
        [(part["statistics"]["rules"], part["statistics"]["steps"]) for part in merged["shards"]]


@pytest.mark.long
def test_failure_found_by_one_run_is_replayed_first_by_the_next(xdist_pytester: pytest.Pytester) -> None:
    """CONF-RUN-5: a mutant killed by a split run is killed at the first example of every part of a rerun from
    other seeds: the failing examples in the shared database are replayed before any program is drawn."""
    database = f"--kv-database={xdist_pytester.path / 'examples'}"
    first, killed = run_split(xdist_pytester, f"--kv-adapter={MUTANT}", "--kv-profile=ci", "--kv-seed=1", database)
    first.assert_outcomes(failed=2)
    assert killed["failed_clause"] == "OFF-READ-1" and killed["statistics"]["found_at_example"] > 1
    rerun, replayed = run_split(xdist_pytester, f"--kv-adapter={MUTANT}", "--kv-profile=ci", "--kv-seed=3",
                                database)
    rerun.assert_outcomes(failed=2)
    assert [(part["failed_clause"], part["statistics"]["found_at_example"])
            for part in replayed["shards"]] == [("OFF-READ-1", 1)] * 2


@pytest.mark.long
def test_cli_workers_run_the_same_split(tmp_path: Path) -> None:
    """`kvconform run --workers 2` runs the plugin's split run under pytest-xdist and prints the merged verdicts."""
    pytest.importorskip("xdist", reason="needs pytest-xdist: pip install -e '.[xdist]'")
    path = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "kvconform.cli", "run", "--workers", "2", "--profile", "smoke",
                           "--database", "none", "--report", str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "conformant in" in done.stdout and "merged from 2 parts" in done.stderr
    assert [part["seed"] for part in json.loads(path.read_text())["shards"]] == [0, 1]


def test_parts_share_the_examples_and_draw_from_their_own_seeds() -> None:
    """CONF-RUN-4: the parts of a split run run the profile's examples between them, each from a seed of its own."""
    parts = [Shard(index, 3) for index in range(3)]
    assert [part.examples(100) for part in parts] == [34, 33, 33]
    assert len({part.seed(7) for part in parts}) == 3
    assert Shard().seed(None) is None and Shard().examples(100) == 100


def test_merge_adds_up_the_parts_statistics() -> None:
    """A run split across workers counts what its parts counted together; its failure was found where the failing
    part found it."""
    first = runner.RunResult("reference", "dev", 1, passed=True, seconds=1.0,
                             statistics=RunStatistics(examples=3, rules=10, steps=20, checks_seconds=0.5))
    failing = runner.RunResult("reference", "dev", 2, passed=False, seconds=2.0, failed_clause="OFF-READ-1",
                               statistics=RunStatistics(examples=2, rules=5, steps=7, found_at_example=2))
    merged = report.merge([report.build(result, "test", Capabilities()) for result in (first, failing)], seed=0)
    assert merged.statistics == RunStatistics(examples=5, rules=15, steps=27, checks_seconds=0.5, found_at_example=2)
    assert [part.statistics for part in merged.shards] == [first.statistics, failing.statistics]


def test_merge_judges_known_failures_over_all_parts() -> None:
    """CONF-RUN-2: a known failure one part saw is not stale; one no part saw is, and fails the merged run."""
    seen = runner.RunResult("reference", "dev", 1, passed=True, seconds=1.0, known_failures={"OFF-READ-1": "seen"},
                            known_failures_met={"OFF-READ-1": 2}, coverage={"OFF-READ-1": 2})
    unseen = runner.RunResult("reference", "dev", 2, passed=True, seconds=2.0, known_failures_met={"OFF-READ-1": 0},
                              coverage={"OFF-READ-1": 3})
    known = {"OFF-READ-1": "the seed bug"}
    parts = [report.build(result, "test", Capabilities(), known) for result in (seen, unseen)]
    merged = report.merge(parts, seed=0)
    verdict = {clause.id: (clause.verdict, clause.exercised) for clause in merged.clauses}["OFF-READ-1"]
    assert (merged.passed, merged.seconds, verdict) == (True, 2.0, ("known failure", 5))
    assert merged.known_failures_met == {"OFF-READ-1": 2}
    stale = report.merge(parts[1:], seed=0)
    assert (stale.passed, stale.failed_clause) == (False, "CONF-RUN-2")
    assert report.merge(parts[1:], seed=0, rare_known_failures=frozenset(known)).passed


@pytest.fixture
def redis_url(tmp_path: Path):
    """A real redis-server on a free local port, for the time of one test."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("needs redis-server: apt-get install -y redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                examples.open_database(url)
                break
            except examples.DatabaseError:
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait()


@pytest.mark.redis
def test_redis_database_replays_a_failure_first(redis_url: str) -> None:
    """CONF-RUN-5: with a Redis database, a failure found by one run is found at the first example of the next."""
    pytest.importorskip("redis", reason="needs the redis client: pip install -e '.[redis]'")
    mutant = MUTANTS["skip-flag-ignored"]

    def run(seed: int) -> runner.RunResult:
        database = examples.RunExamples(examples.open_database(redis_url), ["skip-flag-ignored"])
        return runner.run(mutant.adapter, "skip-flag-ignored", "smoke", seed, database=database)

    first = run(1)
    assert (first.failed_clause, first.statistics.found_at_example > 1) == ("OFF-READ-1", True)
    again = run(3)
    assert (again.failed_clause, again.statistics.found_at_example) == ("OFF-READ-1", 1)


def test_derandomised_run_ignores_the_database(tmp_path: Path) -> None:
    """CONF-RUN-5: a derandomised run draws the same programs whatever the database holds."""
    database = examples.RunExamples(examples.open_database(str(tmp_path)), ["skip-flag-ignored"])
    mutant = MUTANTS["skip-flag-ignored"]
    first = runner.run(mutant.adapter, "skip-flag-ignored", "smoke", None, database=database)
    again = runner.run(mutant.adapter, "skip-flag-ignored", "smoke", None, database=database)
    assert first.statistics.found_at_example == again.statistics.found_at_example > 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("location, message", [
    ("/dev/null/examples", "cannot use the example database /dev/null/examples"),
    ("redis://127.0.0.1:1/0", "cannot reach the example database redis://127.0.0.1:1/0"),
])
def test_unusable_database_is_a_usage_error(pytester: pytest.Pytester, location: str, message: str) -> None:
    """A database that cannot be used stops the run before it starts, with one line."""
    if location.startswith("redis://"):
        pytest.importorskip("redis", reason="needs the redis client: pip install -e '.[redis]'")
    result = pytester.runpytest("--kv-adapter=reference", f"--kv-database={location}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kvconform: {message}*"])
