"""The benchmarks, which of them to run, and one run of them into a report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconform.benchmarks import (
    connectors,
    counterexample,
    engine,
    scaling,
    throughput,
    traces,
    transfer,
    vendor,
    workers,
)
from kvconform.benchmarks.figures import BenchReport, Figure, Progress, build_report
from kvconform.conformance.mutants import MUTANTS


class SelectionError(ValueError):
    """A benchmark or mutant name that does not exist (a usage error)."""


@dataclass(frozen=True)
class Settings:
    throughput: throughput.ThroughputSettings = field(default_factory=throughput.ThroughputSettings)
    counterexample: counterexample.CounterexampleSettings = field(
        default_factory=counterexample.CounterexampleSettings)
    transfer: transfer.TransferSettings = field(default_factory=transfer.TransferSettings)
    scaling: scaling.ScalingSettings = field(default_factory=scaling.ScalingSettings)
    workers: workers.WorkersSettings = field(default_factory=workers.WorkersSettings)
    vendor: vendor.VendorSettings = field(default_factory=vendor.VendorSettings)
    connectors: connectors.ConnectorsSettings = field(default_factory=connectors.ConnectorsSettings)
    traces: traces.TracesSettings = field(default_factory=traces.TracesSettings)
    engine: engine.EngineSettings = field(default_factory=engine.EngineSettings)


BENCHMARKS: dict[str, Callable[[Settings, Progress], list[Figure]]] = {
    throughput.NAME: lambda settings, progress: throughput.measure(settings.throughput, progress),
    counterexample.NAME: lambda settings, progress: counterexample.measure(settings.counterexample, progress),
    transfer.NAME: lambda settings, progress: transfer.measure(settings.transfer, progress),
    scaling.NAME: lambda settings, progress: scaling.measure(settings.scaling, progress),
    workers.NAME: lambda settings, progress: workers.measure(settings.workers, progress),
    vendor.NAME: lambda settings, progress: vendor.measure(settings.vendor, progress),
    connectors.NAME: lambda settings, progress: connectors.measure(settings.connectors, progress),
    traces.NAME: lambda settings, progress: traces.measure(settings.traces, progress),
    engine.NAME: lambda settings, progress: engine.measure(settings.engine, progress),
}
"""Benchmark name → how to run it; the issue's order."""


def pick(names: str | None, known: list[str], what: str) -> list[str]:
    """Return the comma-separated `names` (all of `known` when None), or raise SelectionError naming the unknown."""
    if names is None:
        return list(known)
    picked = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in picked if name not in known]
    if unknown or not picked:
        raise SelectionError(f"unknown {what} {', '.join(unknown) or repr(names)}; choose from {', '.join(known)}")
    return picked


def pick_mutants(names: str | None) -> tuple[str, ...]:
    return tuple(pick(names, list(MUTANTS), "mutant"))


def pick_benchmarks(names: str | None) -> list[str]:
    return pick(names, list(BENCHMARKS), "benchmark")


def run(benchmarks: list[str], settings: Settings, progress: Progress) -> BenchReport:
    """Run the named benchmarks in order and return their figures as one report."""
    started = time.perf_counter()
    figures = [figure for name in benchmarks for figure in BENCHMARKS[name](settings, progress)]
    return build_report(benchmarks, figures, time.perf_counter() - started)
