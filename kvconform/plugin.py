"""The kvconform pytest plugin: `pytest --kv-adapter=NAME|module:factory` runs the conformance suite.

Registered under the `pytest11` entry point, so any project with kvconform installed has the options.
They mirror `kvconform run` and are checked by the same code (`conformance/options.py`) before any test
runs: a mistake is a one-line `pytest.UsageError`. Heavy imports happen only when the suite is requested.

Under pytest-xdist (`pytest -n N`) the state-machine run is split into one part per worker, each drawing its
share of the examples from its own seed (`profiles.Shard`); the workers hand their parts' reports to the
controller, which merges them into the one report (JSON, JUnit, summary) and certifies the merged run.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvconform.conformance.profiles import DEFAULT_PROFILE, PROFILES

if TYPE_CHECKING:
    from kvconform.conformance.options import RunOptions
    from kvconform.conformance.report import RunReport
    from kvconform.conformance.scenarios import Scenario

OPTION_ADAPTER = "--kv-adapter"
OPTION_PROFILE = "--kv-profile"
OPTION_SEED = "--kv-seed"
OPTION_CONNECTOR = "--kv-connector"
OPTION_CONNECTOR_CONFIG = "--kv-connector-config"
OPTION_CONNECTOR_MANIFEST = "--kv-connector-manifest"
OPTION_PD_PROCESSES = "--kv-pd-processes"
OPTION_RANKS = "--kv-ranks"
OPTION_SCHEDULING = "--kv-scheduling"
OPTION_CALL_TIMEOUT = "--kv-call-timeout"
OPTION_DRAIN_TIMEOUT = "--kv-drain-timeout"
OPTION_TENSOR_PARALLEL_SIZE = "--kv-tensor-parallel-size"
OPTION_REPORT = "--kv-report"
OPTION_JUNIT = "--kv-junit"
OPTION_KNOWN_FAILURES = "--kv-known-failures"
OPTION_CERTIFY = "--kv-certify"
OPTION_RECORD_TRACE = "--kv-record-trace"
OPTION_SCENARIOS = "--kv-scenarios"
OPTION_DATABASE = "--kv-database"
OPTION_VLLM = "--kv-vllm"
ENV_ADAPTER = "KVCONFORM_ADAPTER"
SUITE = Path(__file__).with_name("suite.py")
RELEASES_SUITE = Path(__file__).with_name("releases_suite.py")
RELEASES = pytest.StashKey["list[str]"]()
RELEASE_ROWS = pytest.StashKey["list"]()
"""With --kv-vllm: the releases to run on, and each one's row once run (`kvconform.releases.ReleaseResult`)."""

RUN_OPTIONS = pytest.StashKey["RunOptions"]()
SCENARIOS = pytest.StashKey["list[Scenario]"]()
RUN_REPORT = pytest.StashKey["RunReport"]()
SHARD_REPORTS = pytest.StashKey[dict[int, str]]()
"""On the xdist controller: the JSON report of each part of the run, by shard index, as the workers sent them."""
CERTIFICATION_GAPS = pytest.StashKey[list[str]]()
WORKER_SEED = "kvconform_seed"
"""The workerinput key of the seed the controller gives every worker to derive its part's seed from."""
WORKER_SHARDS = "kvconform_shards"
"""The workeroutput key under which a worker sends its parts' reports back."""

# keyword of options.prepare -> dest of the pytest option; options left unset take prepare's defaults
PREPARE_ARGUMENTS = {
    "profile": "kv_profile",
    "seed": "kv_seed",
    "scheduling": "kv_scheduling",
    "call_timeout": "kv_call_timeout",
    "drain_timeout": "kv_drain_timeout",
    "tensor_parallel_size": "kv_tensor_parallel_size",
    "report_path": "kv_report",
    "junit_path": "kv_junit",
    "known_failures_path": "kv_known_failures",
    "certify": "kv_certify",
    "database": "kv_database",
    "record_trace": "kv_record_trace",
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
    group.addoption(OPTION_DRAIN_TIMEOUT, dest="kv_drain_timeout", default=None,
                    help="Seconds a drain steps a connector on its own clock until it is idle (as kvconform run)")
    group.addoption(OPTION_TENSOR_PARALLEL_SIZE, dest="kv_tensor_parallel_size", type=int, default=None,
                    help="Tensor-parallel ranks per engine (as kvconform run --tensor-parallel-size); drawn from "
                         "those the adapter runs if not given")
    group.addoption(OPTION_REPORT, dest="kv_report", type=Path, default=None,
                    help="Write the JSON report of the state-machine run here")
    group.addoption(OPTION_JUNIT, dest="kv_junit", type=Path, default=None,
                    help="Write a JUnit XML report here, one test case per clause")
    group.addoption(OPTION_KNOWN_FAILURES, dest="kv_known_failures", type=Path, default=None,
                    help="File of 'CLAUSE-ID: reason' lines: reported, not fatal; stale entries fail")
    group.addoption(OPTION_CERTIFY, dest="kv_certify", action="store_true",
                    help="Fail unless every run-time-checked MUST clause was exercised and passed")
    group.addoption(OPTION_RECORD_TRACE, dest="kv_record_trace", type=Path, default=None,
                    help="Write the run's trace here, for kvconform check; split across xdist workers, a file per part "
                         "(NAME.part-1-of-N.jsonl, …)")
    group.addoption(OPTION_SCENARIOS, dest="kv_scenarios", type=Path, action="append", default=[],
                    help="A scenario JSON file, or a folder of them, to check besides the bundled ones (repeatable)")
    group.addoption(OPTION_DATABASE, dest="kv_database", default=None,
                    help="Example database: a directory (default .hypothesis/examples), a Redis URL, or none")
    group.addoption(OPTION_VLLM, dest="kv_vllm", default=None,
                    help="Run on each of these vLLM releases (A,B,C or A..B), each in its own environment, one test "
                         "per release, as kvconform run --vllm; --kv-report gets one report with a release column")
    group.addoption(OPTION_CONNECTOR, dest="kv_connector", default=None,
                    help="For vllm-connector: the KV connector, a name vLLM knows or module:Class")
    group.addoption(OPTION_CONNECTOR_CONFIG, dest="kv_connector_config", default=None,
                    help="For vllm-connector: kv_connector_extra_config, JSON")
    group.addoption(OPTION_CONNECTOR_MANIFEST, dest="kv_connector_manifest", default=None,
                    help="For vllm-connector: what the connector claims, a JSON object of Capabilities fields")
    group.addoption(OPTION_PD_PROCESSES, dest="kv_pd_processes", default=None, choices=("1", "2"),
                    help="For vllm-pd: 2 runs the producer engine in a process of its own (default 1: both in this "
                         "one)")
    group.addoption(OPTION_RANKS, dest="kv_ranks", default=None, choices=("processes", "in-process"),
                    help="For vllm-connector or vllm-pd past one tensor-parallel rank: each rank in a process of its "
                         "own (default), or all in this one (faster, for connectors without per-process state)")


def adapter_spec(config: pytest.Config) -> str | None:
    return config.getoption("kv_adapter") or os.environ.get(ENV_ADAPTER)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(id): the spec clause a test checks")
    spec = adapter_spec(config)
    if spec is None:
        return
    if config.getoption("kv_vllm"):
        configure_releases(config, spec)
        return
    from kvconform.conformance import options

    options.select_connector(*(config.getoption(dest) for dest in
                               ("kv_connector", "kv_connector_config", "kv_connector_manifest", "kv_pd_processes",
                                "kv_ranks")))
    given = {keyword: config.getoption(dest) for keyword, dest in PREPARE_ARGUMENTS.items()}
    try:
        config.stash[RUN_OPTIONS] = options.prepare(spec, **{k: v for k, v in given.items() if v is not None})
    except options.UsageProblem as problem:
        raise pytest.UsageError(f"kvconform: {problem}") from None
    try:
        config.stash[SCENARIOS] = scenarios(config.getoption("kv_scenarios"))
    except ValueError as problem:
        raise pytest.UsageError(f"kvconform: {OPTION_SCENARIOS}: {problem}") from None
    if not any(arg.startswith(str(SUITE)) for arg in config.args):
        config.args.append(str(SUITE))
    if getattr(config, "workerinput", None) is None and config.getoption("dist", "no") == "load":
        config.option.dist = "loadgroup"  # each part of the run in a group of its own: one part per worker
    config.stash[SHARD_REPORTS] = {}


def configure_releases(config: pytest.Config, spec: str) -> None:
    """--kv-vllm: check the release list (a mistake is a one-line UsageError) and run the releases suite, one test per
    release; the adapter is built in each release's environment, not here (kvconform.releases)."""
    from kvconform import releases

    try:
        config.stash[RELEASES] = releases.parse_releases(
            config.getoption("kv_vllm"), ready=lambda version: releases.is_ready(releases.environment(version)))
    except releases.ReleaseProblem as problem:
        raise pytest.UsageError(f"kvconform: {problem}") from None
    config.stash[RELEASE_ROWS] = []
    if not any(arg.startswith(str(RELEASES_SUITE)) for arg in config.args):
        config.args.append(str(RELEASES_SUITE))


def release_arguments(config: pytest.Config) -> list[str]:
    """Return the `kvconform run` arguments the --kv-* options given stand for, for each release's run."""
    names = {**{dest: f"--{dest.replace('_', '-').removeprefix('kv-')}" for dest in PREPARE_ARGUMENTS.values()},
             "kv_adapter": "--adapter", "kv_connector": "--connector", "kv_connector_config": "--connector-config",
             "kv_connector_manifest": "--connector-manifest", "kv_pd_processes": "--pd-processes",
             "kv_ranks": "--ranks"}
    arguments = ["--adapter", str(adapter_spec(config))]
    for dest, name in names.items():
        value = config.getoption(dest)
        if dest in ("kv_adapter", "kv_report", "kv_junit") or value in (None, False):
            continue
        arguments += [name] if value is True else [name, str(value)]
    return arguments


def shard_count(config: pytest.Config) -> int:
    """Return how many parts the state-machine run is split into: one per pytest-xdist worker."""
    workerinput = getattr(config, "workerinput", None)
    return 1 if workerinput is None else workerinput["workercount"]


def split_run_options(config: pytest.Config, run: RunOptions) -> RunOptions:
    """Return the options of a run split across `shard_count` workers: the seed its parts derive theirs from."""
    if shard_count(config) == 1 or run.seed is not None:
        return run
    # pytest-xdist sets `workerinput` on a worker's config; pytest's Config does not declare it
    return dataclasses.replace(run, seed=config.workerinput[WORKER_SEED])  # type: ignore[attr-defined]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist: give every worker the seed from which the parts of a run without --kv-seed derive theirs.

    It is 0 for a derandomised profile, whose parts then draw the same programs every time, and a random seed
    for a random profile; the merged report names it, so that the run can be repeated with --kv-seed.
    """
    run = node.config.stash.get(RUN_OPTIONS, None)
    if run is None or node.workerinput["workercount"] == 1:
        return
    if run.seed is None:
        from kvconform.conformance.profiles import PROFILES

        seed = 0 if PROFILES[run.profile].derandomize else random.SystemRandom().randrange(2**32)
        node.config.stash[RUN_OPTIONS] = run = dataclasses.replace(run, seed=seed)
    node.workerinput[WORKER_SEED] = run.seed


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist: keep the reports of the parts a worker ran."""
    reports = node.config.stash.get(SHARD_REPORTS, None)
    if reports is not None:
        reports.update(getattr(node, "workeroutput", {}).get(WORKER_SHARDS, {}))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Split the state-machine run into one part per xdist worker, each in an xdist group of its own."""
    if "kv_shard" not in metafunc.fixturenames:
        return
    from kvconform.conformance.profiles import Shard

    count = shard_count(metafunc.config)
    metafunc.parametrize("kv_shard", [
        pytest.param(Shard(index, count), id=f"part-{index + 1}-of-{count}",
                     marks=pytest.mark.xdist_group(f"kvconform-part-{index + 1}")) for index in range(count)])


def keep_part_report(config: pytest.Config, shard, run_report: RunReport) -> bool:
    """Keep the report of a part of the run on an xdist worker, for the controller to merge; say if it was kept."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput.setdefault(WORKER_SHARDS, {})[shard.index] = run_report.model_dump_json()
    return workeroutput is not None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On the xdist controller: merge the parts' reports into the run's report, write it and certify it."""
    config = session.config
    rows = config.stash.get(RELEASE_ROWS, None)
    if rows:
        from kvconform import releases
        from kvconform.conformance import report

        gathered = releases.gather(str(adapter_spec(config)), config.getoption("kv_profile") or DEFAULT_PROFILE, rows,
                                   sum(row.seconds for row in rows))
        for path, render in ((config.getoption("kv_report"), lambda: gathered.model_dump_json(indent=2)),
                             (config.getoption("kv_junit"), lambda: releases.junit_xml(gathered))):
            if path is not None:
                report.write_atomically(path, render())
        return
    parts = config.stash.get(SHARD_REPORTS, {})
    run = config.stash.get(RUN_OPTIONS, None)
    if not parts or run is None:
        return
    from kvconform.conformance import options, report

    merged = report.merge([report.RunReport.model_validate_json(parts[index]) for index in sorted(parts)], run.seed,
                          run.rare_known_failures)
    config.stash[RUN_REPORT] = merged
    try:
        options.write_reports(merged, run.report_path, run.junit_path)
    except options.UsageProblem as problem:
        sys.stderr.write(f"ERROR: kvconform: {problem}\n")
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    config.stash[CERTIFICATION_GAPS] = gaps = options.certification_gaps(run, merged)
    if gaps or not merged.passed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def scenarios(paths: list[Path]) -> list[Scenario]:
    """Return the bundled scenarios and those in `paths` (files, or folders of `*.json` files); raise ValueError,
    one line naming the file, on a missing or malformed one."""
    from kvconform.conformance.scenarios import bundled, load, load_file

    files = [file for path in paths for file in (sorted(path.glob("*.json")) if path.is_dir() else [path])]
    loaded = [load(name) for name in bundled()]
    for file in files:
        try:
            loaded.append(load_file(file))
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
            *(f"kvconform: {line}" for line in run.banner()),
            f"kvconform: capabilities {run.capabilities}",
            f"kvconform: environment {env}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    run_report = config.stash.get(RUN_REPORT, None)
    if run_report is None:
        return
    terminalreporter.section("kvconform")
    terminalreporter.write_line(f"spec {run_report.spec_version}, adapter {run_report.adapter}: "
                                f"{run_report.run_time_coverage.summary()} "
                                f"({run_report.statistics.steps} steps judged)")
    if run_report.shards:
        terminalreporter.write_line(f"merged from {len(run_report.shards)} parts drawn from seed {run_report.seed}: "
                                    + ", ".join(f"seed {part.seed} {part.outcome} ({part.statistics.examples} examples)"
                                                for part in run_report.shards))
    for gap in config.stash.get(CERTIFICATION_GAPS, []):
        terminalreporter.write_line(f"not certified: {gap}")
    for name, count in run_report.known_failures_met.items():
        terminalreporter.write_line(f"known failure {name} (met {count} times): "
                                    f"{run_report.known_failures[name.split()[0]]}")
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


@pytest.fixture
def kv_shard(request: pytest.FixtureRequest):
    """The part of the state-machine run this test runs: the whole run unless pytest-xdist split it."""
    return request.param
