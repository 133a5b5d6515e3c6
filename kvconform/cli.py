"""The `kvconform` command line: run the conformance kit against an adapter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvconform.conformance.calls import DEFAULT_CALL_TIMEOUT

EXIT_CONFORMANT, EXIT_NONCONFORMANT, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@click.group()
@click.version_option(package_name="kvconform")
def main() -> None:
    """Executable specification and conformance kit for vLLM-style KV offload connectors."""


@main.command("run")
@click.option("--adapter", "adapter_spec", default="reference", show_default=True,
              help="Registered adapter name or module:factory")
@click.option("--profile", default="ci", show_default=True, help="Hypothesis profile: ci, dev or thorough")
@click.option("--seed", type=int, default=None, help="Random seed (turns off the ci profile's derandomisation)")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON report here")
@click.option("--call-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_CALL_TIMEOUT,
              show_default=True, help="Seconds one adapter call may take before its outcome is reported unknown")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here, one test case per clause")
@click.option("--known-failures", "known_failures_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="File of 'CLAUSE-ID: reason' lines: reported, not fatal; stale entries fail")
@click.option("--certify", is_flag=True, help="Fail unless every run-time-checked MUST clause was exercised and passed")
@click.option("--scheduling", type=click.Choice(["sync", "async", "both"]), default="both", show_default=True,
              help="Scheduling modes to draw engine configurations from")
def run_command(adapter_spec: str, profile: str, seed: int | None, report_path: Path | None, call_timeout: float,
                junit_path: Path | None, known_failures_path: Path | None, certify: bool, scheduling: str) -> None:
    """Run the conformance state machine against an adapter and print a verdict per clause."""
    from kvconform.conformance import baseline, report, runner
    from kvconform.conformance.profiles import PROFILES

    console = Console(stderr=True)
    if profile not in PROFILES:
        _usage_error(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    for path in (report_path, junit_path):
        if path is not None:
            _check_writable(path)
    known = baseline.Baseline()
    if known_failures_path is not None:
        try:
            known = baseline.load(known_failures_path)
        except baseline.BaselineError as error:
            _usage_error(str(error))
    factory, capabilities, version = _probe(adapter_spec, call_timeout)
    if scheduling == "async" and not capabilities.async_scheduling:
        _usage_error(f"adapter {adapter_spec!r} does not support async scheduling (its capabilities say so)")
    console.print(f"kvconform: adapter [bold]{adapter_spec}[/] {version}, profile {profile}, seed {seed}, "
                  f"scheduling {scheduling}")
    examples = PROFILES[profile]["max_examples"]
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("examples", total=examples)
            result = runner.run(factory, adapter_spec, profile, seed,
                                on_example=lambda: progress.advance(task), call_timeout=call_timeout,
                                baseline=known, scheduling=scheduling)
    except KeyboardInterrupt:
        click.echo("kvconform: interrupted; no report written", err=True)
        sys.exit(EXIT_INTERRUPTED)
    run_report = report.build(result, version, capabilities, known.entries)
    _print_table(Console(), run_report)
    for path, text in ((report_path, run_report.model_dump_json(indent=2)), (junit_path, report.junit_xml(run_report))):
        if path is not None:
            try:
                report.write_atomically(path, text)
            except OSError as error:
                _usage_error(f"cannot write the report to {path}: {error.strerror or error}")
    gaps = report.certification_gaps(run_report) if certify else []
    for gap in gaps:
        click.echo(f"kvconform: not certified: {gap}", err=True)
    sys.exit(EXIT_CONFORMANT if result.passed and not gaps else EXIT_NONCONFORMANT)


def _check_writable(path: Path) -> None:
    """Exit 2 before a long run whose report could not be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        _usage_error(f"cannot write the report to {path}: {error.strerror or error}")
    if not os.access(path.parent, os.W_OK):
        _usage_error(f"cannot write the report to {path}: directory {path.parent} is not writable")


def _probe(adapter_spec: str, call_timeout: float):
    """Return the adapter's factory, capabilities and version, or exit 2 when it cannot even be asked."""
    from kvconform.adapters.registry import AdapterNotFound, resolve
    from kvconform.conformance.calls import AdapterCaller, AdapterHung
    from kvconform.conformance.checks import ClauseViolation

    caller = AdapterCaller(call_timeout)
    try:
        factory = resolve(adapter_spec)
        caller.build(factory)
        capabilities, version = caller("capabilities"), caller("implementation_version")
        caller("close")
    except AdapterNotFound as error:
        _usage_error(str(error))
    except (ClauseViolation, AdapterHung) as error:
        if isinstance(error.__cause__, AdapterNotFound):
            _usage_error(str(error.__cause__))
        _usage_error(f"adapter {adapter_spec!r} cannot be used: {error.detail}")
    return factory, capabilities, version


def _print_table(console: Console, run_report) -> None:
    table = Table(title=f"kvconform spec {run_report.spec_version}: {run_report.adapter}")
    for column in ("clause", "level", "verdict", "exercised"):
        table.add_column(column)
    style = {"pass": "green", "fail": "bold red", "not exercised": "yellow", "known failure": "magenta"}
    for clause in run_report.clauses:
        table.add_row(clause.id, clause.level, f"[{style[clause.verdict]}]{clause.verdict}[/]", str(clause.exercised))
    console.print(table)
    if run_report.outcome == "ok":
        console.print(f"[green]conformant[/] in {run_report.seconds:.1f}s, {run_report.steps} steps compared")
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


def _usage_error(message: str) -> None:
    click.echo(f"kvconform: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@main.command("bench")
@click.option("--only", default=None, metavar="NAMES",
              help="Comma-separated benchmarks: throughput, counterexample, transfer, scaling (default: all)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("kvconform-bench.json"), show_default=True, help="Write every figure as JSON here")
@click.option("--seeds", type=click.IntRange(min=1), default=10, show_default=True,
              help="Seeds per mutant in the counterexample benchmark")
@click.option("--mutants", default=None, metavar="NAMES",
              help="Comma-separated mutants for the counterexample benchmark (default: the whole catalogue)")
def bench_command(only: str | None, json_path: Path, seeds: int, mutants: str | None) -> None:
    """Measure harness throughput, time to counterexample, transfer bandwidth and scaling; print a table."""
    import dataclasses

    from kvconform.benchmarks import figures, suite
    from kvconform.conformance import report

    try:
        benchmarks = suite.pick_benchmarks(only)
        settings = suite.Settings(counterexample=dataclasses.replace(
            suite.Settings().counterexample, seeds=seeds, mutants=suite.pick_mutants(mutants)))
    except suite.SelectionError as error:
        _usage_error(str(error))
    _check_writable(json_path)
    progress = Console(stderr=True)
    try:
        bench_report = suite.run(benchmarks, settings, lambda line: progress.print(line, highlight=False))
    except KeyboardInterrupt:
        click.echo("kvconform: interrupted; no report written", err=True)
        sys.exit(EXIT_INTERRUPTED)
    Console().print(figures.table(bench_report))
    try:
        report.write_atomically(json_path, bench_report.model_dump_json(indent=2))
    except OSError as error:
        _usage_error(f"cannot write the report to {json_path}: {error.strerror or error}")
    click.echo(f"kvconform: {len(bench_report.figures)} figures in {bench_report.seconds:.0f} s, "
               f"written to {json_path}", err=True)


@main.command("adapters")
def adapters_command() -> None:
    """List the registered adapters."""
    from kvconform.adapters.registry import available

    for name, target in sorted(available().items()):
        click.echo(f"{name}\t{target}")


if __name__ == "__main__":
    main()
