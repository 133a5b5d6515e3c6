"""The pytest plugin: `pytest --kv-adapter=…` runs the suite, writes the reports, and rejects bad options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from kvconform.conformance import scenarios
from kvconform.spec import registry

pytest_plugins = ["pytester"]

MUTANT = "kvconform_test_mutant:make"


def test_loading_the_plugin_imports_no_hypothesis() -> None:
    """Every pytest session of a project with kvconform installed loads the plugin: loading it imports no Hypothesis
    module, internals least of all; a run imports Hypothesis when it starts."""
    script = ("import sys, kvconform.plugin; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hypothesis'))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("profile", ["smoke", pytest.param("ci", marks=pytest.mark.long)])
def test_reference_passes_and_writes_both_reports(pytester: pytest.Pytester, tmp_path: Path, profile: str) -> None:
    """The reference passes the suite and gets a JSON and a per-clause JUnit report; at ci it is certified: every
    run-time clause exercised (CONF-CERT-1)."""
    report, junit = tmp_path / "run.json", tmp_path / "run.xml"
    certify = ["--kv-certify"] if profile == "ci" else []
    result = pytester.runpytest("--kv-adapter=reference", f"--kv-profile={profile}", f"--kv-report={report}",
                                f"--kv-junit={junit}", *certify)
    pair = [name for name in bundled() if scenarios.load(name).level == "disaggregated"]  # refused: one engine
    result.assert_outcomes(passed=1 + len(bundled()) - len(pair), skipped=len(pair))
    result.stdout.fnmatch_lines([f"kvconform: adapter reference *, profile {profile}, the profile's own seed, "
                                 "scheduling both",
                                 f"spec {registry.spec_version()}, adapter reference: */* MUST clauses judged at run "
                                 "time (*): * passed, 0 failed, 0 known failures, "
                                 f"{'0' if certify else '*'} not exercised, 0 not applicable; * model-only *"])
    written = json.loads(report.read_text())
    assert (written["adapter"], written["outcome"], written["spec_version"]) == ("reference", "ok",
                                                                                 registry.spec_version())
    cases = ElementTree.parse(junit).getroot().iter("testcase")
    assert sorted(case.get("name").split()[0] for case in cases) == sorted(registry.clauses())


def test_seed_mutant_fails_naming_its_clause(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """The seed bug (vLLM #44585) fails the state machine and the sync seed scenarios with OFF-READ-1; so does the
    report."""
    report = tmp_path / "run.json"
    result = pytester.runpytest(f"--kv-adapter={MUTANT}", "--kv-scheduling=sync", f"--kv-report={report}",
                                "-k", "test_state_machine or seed")
    result.assert_outcomes(failed=1 + len(bundled("sync", "seed")), skipped=len(bundled("async", "seed")),
                           deselected=len(bundled()) - len(bundled("both", "seed")))
    result.stdout.fnmatch_lines(["[[]OFF-READ-1[]] adapter.step(): request * skips reading cached KV*",
                                 "counterexample:", "adapter.start(EngineConfig(*"])
    written = json.loads(report.read_text())
    assert (written["outcome"], written["failed_clause"]) == ("fail", "OFF-READ-1")


def test_known_failure_is_an_xfail(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """CONF-RUN-2: a scenario failing a clause listed in --kv-known-failures is an xfail that gives the reason."""
    known = tmp_path / "known.txt"
    known.write_text("OFF-READ-1: the seed bug  # vLLM PR #44592\n")
    result = pytester.runpytest(f"--kv-adapter={MUTANT}", f"--kv-known-failures={known}", "-k",
                                "test_scenario and seed", "-rx")
    result.assert_outcomes(xfailed=len(bundled("both", "seed")),
                           deselected=1 + len(bundled()) - len(bundled("both", "seed")))
    result.stdout.fnmatch_lines(["XFAIL *seed-skip-read-sync* - known failure OFF-READ-1: the seed bug"])


@pytest.mark.parametrize("options, message", [
    (["--kv-adapter=no-such-adapter"], "unknown adapter 'no-such-adapter'"),
    (["--kv-adapter=reference", "--kv-profile=nightly-ish"], "unknown profile 'nightly-ish'"),
    (["--kv-adapter=reference", "--kv-scheduling=sometimes"], "unknown scheduling 'sometimes'"),
    (["--kv-adapter=reference", "--kv-call-timeout=0"], "the call timeout must be more than 0 seconds"),
    (["--kv-adapter=reference", "--kv-drain-timeout=soon"], "the drain timeout must be a positive number of seconds"),
    (["--kv-adapter=reference", "--kv-known-failures=missing.txt"], "cannot read known-failures file"),
    (["--kv-adapter=reference", "--kv-report=/dev/null/run.json"], "cannot write the report"),
    (["--kv-adapter=faulty_adapters:SyncOnlyAdapter", "--kv-scheduling=async"], "does not support async scheduling"),
])
def test_bad_option_is_a_usage_error(pytester: pytest.Pytester, options: list[str], message: str) -> None:
    """A mistake in the --kv-* options stops pytest before any test with one line, as `kvconform run` does."""
    result = pytester.runpytest(*options)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kvconform: *{message}*"])
    assert "Traceback" not in result.stderr.str()


def test_a_users_scenario_files_run_with_the_bundled_ones(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """--kv-scenarios adds a user's files (or a folder of them): met, or failed with the diff of the step."""
    from kvconform.common.values import EngineConfig
    from kvconform.conformance.scenarios import Scenario

    config = EngineConfig(block_size=4, block_size_factor=1, num_gpu_blocks=16, num_offload_blocks=8,
                          async_scheduling=False)
    folder = tmp_path / "scenarios"
    folder.mkdir()
    for name, tokens in (("mine-met", 8), ("mine-wrong", 7)):
        scenario = Scenario(config).add("r", [1] * 8).step(scheduled_tokens={"r": tokens})
        (folder / f"{name}.json").write_text(json.dumps(scenario.to_json()))
    result = pytester.runpytest("--kv-adapter=reference", f"--kv-scenarios={folder}", "-k", "mine", "-rf")
    result.assert_outcomes(passed=1, failed=1, deselected=1 + len(bundled()))
    result.stdout.fnmatch_lines(["*[[]SCENARIO[]] scenario mine-wrong, op 1 (step): expected vs observed*",
                                 "*- expected {'r': 7}*", "*+ observed {'r': 8}*"])


def test_a_malformed_scenario_file_is_a_usage_error(pytester: pytest.Pytester, tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"config": {"block_size": 4}, "ops": [{"op": "jump"}]}))
    result = pytester.runpytest("--kv-adapter=reference", f"--kv-scenarios={broken}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kvconform: --kv-scenarios: {broken}: *"])


def bundled(scheduling: str = "both", prefix: str = "") -> list[str]:
    """Return the names of the bundled scenarios that use `scheduling` (sync, async or both) and start with `prefix`."""
    wanted = {"sync": {False}, "async": {True}, "both": {False, True}}[scheduling]
    return [name for name in scenarios.bundled()
            if name.startswith(prefix) and scenarios.load(name).config.async_scheduling in wanted]
