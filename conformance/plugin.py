"""The kvconform pytest plugin: `pytest --kv-adapter=NAME|module:factory` runs the conformance suite.

Registered under the `pytest11` entry point, so any project with kvconform installed has the options.
They mirror `kvconform run` and are checked by the same code (`conformance/options.py`) before any test
runs: a mistake is a one-line `pytest.UsageError`. Heavy imports happen only when the suite is requested.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvconform.conformance.profiles import DEFAULT_PROFILE, PROFILES

if TYPE_CHECKING:
    from kvconform.conformance.options import RunOptions
    from kvconform.conformance.report import RunReport
    from kvconform.conformance.vectors import Vector

OPTION_ADAPTER = "--kv-adapter"
OPTION_PROFILE = "--kv-profile"
OPTION_SEED = "--kv-seed"
OPTION_CONNECTOR = "--kv-connector"
OPTION_CONNECTOR_CONFIG = "--kv-connector-config"
OPTION_CONNECTOR_MANIFEST = "--kv-connector-manifest"
OPTION_SCHEDULING = "--kv-scheduling"
OPTION_CALL_TIMEOUT = "--kv-call-timeout"
OPTION_REPORT = "--kv-report"
OPTION_JUNIT = "--kv-junit"
OPTION_KNOWN_FAILURES = "--kv-known-failures"
OPTION_CERTIFY = "--kv-certify"
OPTION_SCENARIOS = "--kv-scenarios"
ENV_ADAPTER = "KVCONFORM_ADAPTER"
SUITE = Path(__file__).with_name("suite.py")

RUN_OPTIONS = pytest.StashKey["RunOptions"]()
SCENARIOS = pytest.StashKey["list[Vector]"]()
RUN_REPORT = pytest.StashKey["RunReport"]()

# keyword of options.prepare -> dest of the pytest option; options left unset take prepare's defaults
PREPARE_ARGUMENTS = {
    "profile": "kv_profile",
    "seed": "kv_seed",
    "scheduling": "kv_scheduling",
    "call_timeout": "kv_call_timeout",
    "report_path": "kv_report",
    "junit_path": "kv_junit",
    "known_failures_path": "kv_known_failures",
    "certify": "kv_certify",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform", "KV connector conformance (the options of `kvconform run`)")
    group.addoption(OPTION_ADAPTER, dest="kv_adapter", default=None,
                    help=f"Adapter to check: registered name or module:factory (or set {ENV_ADAPTER})")
    group.addoption(OPTION_PROFILE, dest="kv_profile", default=None,
                    help=f"Hypothesis profile: {', '.join(PROFILES)} (default {DEFAULT_PROFILE})")
    group.addoption(OPTION_SEED, dest="kv_seed", type=int, default=None,
                    help="Random seed (turns off the ci profile's derandomisation)")
    group.addoption(OPTION_SCHEDULING, dest="kv_scheduling", default=None,
                    help="Scheduling modes to draw engine configurations from: sync, async or both (default)")
    group.addoption(OPTION_CALL_TIMEOUT, dest="kv_call_timeout", type=float, default=None,
                    help="Seconds one adapter call may take before its outcome is reported unknown")
    group.addoption(OPTION_REPORT, dest="kv_report", type=Path, default=None,
                    help="Write the JSON report of the state-machine run here")
    group.addoption(OPTION_JUNIT, dest="kv_junit", type=Path, default=None,
                    help="Write a JUnit XML report here, one test case per clause")
    group.addoption(OPTION_KNOWN_FAILURES, dest="kv_known_failures", type=Path, default=None,
                    help="File of 'CLAUSE-ID: reason' lines: reported, not fatal; stale entries fail")
    group.addoption(OPTION_CERTIFY, dest="kv_certify", action="store_true",
                    help="Fail unless every run-time-checked MUST clause was exercised and passed")
    group.addoption(OPTION_SCENARIOS, dest="kv_scenarios", type=Path, action="append", default=[],
                    help="A scenario JSON file, or a folder of them, to check besides the bundled ones (repeatable)")
    group.addoption(OPTION_CONNECTOR, dest="kv_connector", default=None,
                    help="For vllm-connector: the KV connector, a name vLLM knows or module:Class")
    group.addoption(OPTION_CONNECTOR_CONFIG, dest="kv_connector_config", default=None,
                    help="For vllm-connector: kv_connector_extra_config, JSON")
    group.addoption(OPTION_CONNECTOR_MANIFEST, dest="kv_connector_manifest", default=None,
                    help="For vllm-connector: what the connector claims, a JSON object of Capabilities fields")


def adapter_spec(config: pytest.Config) -> str | None:
    return config.getoption("kv_adapter") or os.environ.get(ENV_ADAPTER)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(id): the spec clause a test checks")
    spec = adapter_spec(config)
    if spec is None:
        return
    from kvconform.conformance import options

    options.select_connector(*(config.getoption(dest) for dest in
                               ("kv_connector", "kv_connector_config", "kv_connector_manifest")))
    given = {keyword: config.getoption(dest) for keyword, dest in PREPARE_ARGUMENTS.items()}
    try:
        config.stash[RUN_OPTIONS] = options.prepare(spec, **{k: v for k, v in given.items() if v is not None})
    except options.UsageProblem as problem:
        raise pytest.UsageError(f"kvconform: {problem}") from None
    try:
        config.stash[SCENARIOS] = scenarios(config.getoption("kv_scenarios"))
    except ValueError as problem:
        raise pytest.UsageError(f"kvconform: {OPTION_SCENARIOS}: {problem}") from None
    if str(SUITE) not in config.args:
        config.args.append(str(SUITE))


def scenarios(paths: list[Path]) -> list[Vector]:
    """Return the bundled scenarios and those in `paths` (files, or folders of `*.json` files); raise ValueError,
    one line naming the file, on a missing or malformed one."""
    from kvconform.conformance import vectors

    files = [file for path in paths for file in (sorted(path.glob("*.json")) if path.is_dir() else [path])]
    loaded = [vectors.load(name) for name in vectors.bundled()]
    for file in files:
        try:
            loaded.append(vectors.load_file(file))
        except (OSError, ValueError) as problem:
            raise ValueError(f"{file}: {problem}") from None
    return loaded


def pytest_report_header(config: pytest.Config) -> list[str]:
    run = config.stash.get(RUN_OPTIONS, None)
    if run is None:
        return []
    from kvconform.conformance import options

    env = {k: v for k, v in os.environ.items() if k.startswith("KVCONFORM_")}
    return [f"kvconform: adapter {run.adapter_spec} {run.implementation_version}, profile {run.profile}, "
            f"{options.seed_words(run.seed)}, scheduling {run.scheduling}",
            f"kvconform: capabilities {run.capabilities}",
            f"kvconform: environment {env}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    run_report = config.stash.get(RUN_REPORT, None)
    if run_report is None:
        return
    terminalreporter.section("kvconform")
    terminalreporter.write_line(f"spec {run_report.spec_version}, adapter {run_report.adapter}: "
                                f"{run_report.run_time_coverage.summary()} ({run_report.steps} steps judged)")
    for clause, reason in sorted(run_report.known_failures.items()):
        terminalreporter.write_line(f"known failure {clause}: {reason}")
    run = config.stash[RUN_OPTIONS]
    for path in (run.report_path, run.junit_path):
        if path is not None:
            terminalreporter.write_line(f"report written to {path}")


@pytest.fixture(scope="session")
def kv_run_options(pytestconfig: pytest.Config) -> RunOptions:
    """The checked options of the run, as chosen by --kv-adapter and the other --kv-* options."""
    if RUN_OPTIONS not in pytestconfig.stash:
        raise pytest.UsageError(f"no adapter chosen: pass {OPTION_ADAPTER}=NAME|module:factory or set {ENV_ADAPTER}")
    return pytestconfig.stash[RUN_OPTIONS]


@pytest.fixture(scope="session")
def kv_adapter_factory(kv_run_options: RunOptions):
    """The factory of the adapter under test, as chosen by --kv-adapter."""
    return kv_run_options.factory
