"""The `kvconform` command line: run the conformance kit against an adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

EXIT_CONFORMANT, EXIT_NONCONFORMANT, EXIT_USAGE = 0, 1, 2


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
def run_command(adapter_spec: str, profile: str, seed: int | None, report_path: Path | None) -> None:
    """Run the conformance state machine against an adapter and print a verdict per clause."""
    from kvconform.adapters.registry import AdapterNotFound, resolve
    from kvconform.conformance import report, runner
    from kvconform.conformance.profiles import PROFILES

    console = Console(stderr=True)
    if profile not in PROFILES:
        _usage_error(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    try:
        factory = resolve(adapter_spec)
        probe = factory()
        capabilities, version = probe.capabilities(), probe.implementation_version()
        probe.close()
    except AdapterNotFound as error:
        _usage_error(str(error))
    except Exception as error:  # the adapter could not even be built: a configuration problem
        _usage_error(f"adapter {adapter_spec!r} could not be built: {type(error).__name__}: {error}")
    console.print(f"kvconform: adapter [bold]{adapter_spec}[/] {version}, profile {profile}, seed {seed}")
    examples = PROFILES[profile]["max_examples"]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("examples", total=examples)
        result = runner.run(factory, adapter_spec, profile, seed,
                            on_example=lambda: progress.advance(task))
    run_report = report.build(result, version, capabilities)
    _print_table(Console(), run_report)
    if report_path is not None:
        report.write_atomically(report_path, run_report.model_dump_json(indent=2))
    sys.exit(EXIT_CONFORMANT if result.passed else EXIT_NONCONFORMANT)


def _print_table(console: Console, run_report) -> None:
    table = Table(title=f"kvconform spec {run_report.spec_version}: {run_report.adapter}")
    for column in ("clause", "level", "verdict", "exercised"):
        table.add_column(column)
    style = {"pass": "green", "fail": "bold red", "not exercised": "yellow"}
    for clause in run_report.clauses:
        table.add_row(clause.id, clause.level, f"[{style[clause.verdict]}]{clause.verdict}[/]", str(clause.exercised))
    console.print(table)
    if run_report.passed:
        console.print(f"[green]conformant[/] in {run_report.seconds:.1f}s")
    else:
        console.print(f"[bold red]NOT conformant[/]: {run_report.failed_clause}: {run_report.message}")
        console.print("counterexample (replayable steps):")
        console.print(run_report.counterexample or "(none captured)", markup=False, highlight=False)


def _usage_error(message: str) -> None:
    click.echo(f"kvconform: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


@main.command("adapters")
def adapters_command() -> None:
    """List the registered adapters."""
    from kvconform.adapters.registry import available

    for name, target in sorted(available().items()):
        click.echo(f"{name}\t{target}")
