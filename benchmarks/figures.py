"""What a benchmark run reports: figures with their targets, the machine, the table and the JSON."""

from __future__ import annotations

import datetime
import math
import os
import platform
from collections.abc import Callable

import torch
from pydantic import BaseModel, Field, computed_field
from rich.table import Table

from kvconform.common.version import KIT_VERSION

Progress = Callable[[str], None]
"""Where a benchmark reports what it is doing, one line at a time."""

UNIT_FORMATS = {
    "steps/s": lambda value: f"{value:,.0f} steps/s",
    "rules/s": lambda value: f"{value:,.0f} rules/s",
    "rules/CPU-s": lambda value: f"{value:,.0f} rules/CPU-s",
    "examples/s": lambda value: f"{value:,.1f} examples/s",
    "fraction": lambda value: f"{value:.1%}",
    "s": lambda value: f"{value:.2f} s",
    "requests": lambda value: f"{value:g} requests",
    "bytes/s": lambda value: f"{value / 1e9:.2f} GB/s",
    "ratio": lambda value: f"{value:.2f}",
    "µs/step": lambda value: f"{value:,.0f} µs/step",
    "bytes/step": lambda value: f"{value:,.0f} bytes/step",
    "tokens/s": lambda value: f"{value:,.0f} tokens/s",
}
"""How a value of each unit is shown in the table; the JSON keeps the plain number."""


def show(value: float, unit: str) -> str:
    return UNIT_FORMATS[unit](value)


class Target(BaseModel):
    """A figure's goal: at least `bound`, or at most `bound`."""

    bound: float
    at_least: bool

    def met_by(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound

    def describe(self, unit: str) -> str:
        return f"{'≥' if self.at_least else '≤'} {show(self.bound, unit)}"


def at_least(bound: float) -> Target:
    return Target(bound=bound, at_least=True)


def at_most(bound: float) -> Target:
    return Target(bound=bound, at_least=False)


class Figure(BaseModel):
    """One measured rate, ratio or count, with its target if the issue sets one."""

    benchmark: str
    figure: str
    value: float | None = Field(description="None when it cannot be measured here; the note says why")
    unit: str
    target: Target | None = None
    note: str = ""

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented form
    @property
    def met(self) -> bool | None:
        """Whether the target holds; None without a target or a value."""
        if self.target is None or self.value is None:
            return None
        return self.target.met_by(self.value)


class Machine(BaseModel):
    cores: int
    torch: str
    torch_threads: int
    python: str
    platform: str
    device: str = Field(description="the CUDA device the transfer benchmark also used, or 'cpu only'")


class BenchReport(BaseModel):
    """One `kvconform bench` run."""

    kvconform_version: str
    date: str
    seconds: float
    benchmarks: list[str]
    machine: Machine
    figures: list[Figure]


def this_machine() -> Machine:
    cuda = torch.cuda.is_available()
    return Machine(cores=os.cpu_count() or 1, torch=torch.__version__, torch_threads=torch.get_num_threads(),
                   python=platform.python_version(), platform=platform.platform(),
                   device=torch.cuda.get_device_name() if cuda else "cpu only")


def build_report(benchmarks: list[str], figures: list[Figure], seconds: float) -> BenchReport:
    for figure in figures:
        if figure.value is not None and not math.isfinite(figure.value):
            raise ValueError(f"{figure.benchmark}: {figure.figure} is not a finite number: {figure.value}")
    return BenchReport(kvconform_version=KIT_VERSION,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       seconds=seconds, benchmarks=benchmarks, machine=this_machine(), figures=figures)


def table(report: BenchReport) -> Table:
    """Return the rich table: benchmark, figure, value, target, met?"""
    machine = report.machine
    result = Table(title=f"kvconform bench: {machine.cores} cores, torch {machine.torch}, {machine.device}")
    for column in ("benchmark", "figure", "value", "target", "met?"):
        result.add_column(column)
    verdicts = {True: "[green]yes[/]", False: "[bold red]no[/]", None: ""}
    for figure in report.figures:
        value = "not available" if figure.value is None else show(figure.value, figure.unit)
        if figure.note:
            value += f"\n[dim]{figure.note}[/]"
        target = figure.target.describe(figure.unit) if figure.target else ""
        result.add_row(figure.benchmark, figure.figure, value, target, verdicts[figure.met])
    return result
