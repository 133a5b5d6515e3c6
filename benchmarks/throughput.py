"""Benchmark 1: harness throughput, the reference adapter run against the reference model.

The machine may be shared: the wall-clock rates carry the load average in their note, and the rate per CPU-second
of the run's own process is the figure that other processes' load moves least.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.conformance import runner

NAME = "throughput"


@dataclass(frozen=True)
class ThroughputSettings:
    profile: str = "ci"


def measure(settings: ThroughputSettings, progress: Progress) -> list[Figure]:
    """Return rule steps and compared engine steps per second, and how the run's time splits between Hypothesis
    (rule selection, draws, preconditions), the kit's handling of calls, the checks, the reference and the adapter."""
    progress(f"{NAME}: reference adapter, profile {settings.profile}")
    load = os.getloadavg()[0]
    cpu_started = time.process_time()
    result = runner.run(ReferenceAdapter, "reference", settings.profile)
    cpu_seconds = time.process_time() - cpu_started
    statistics = result.statistics
    hypothesis = result.seconds - statistics.execution_seconds
    calls = (statistics.execution_seconds - statistics.adapter_seconds - statistics.reference_seconds
             - statistics.checks_seconds)
    note = (f"{statistics.rules:,} rules and {statistics.steps:,} engine steps in {result.seconds:.1f} s, "
            f"profile {settings.profile}, load average {load:.2f} → {os.getloadavg()[0]:.2f}")
    if not result.passed:
        note += f"; the run FAILED {result.failed_clause}"

    def share(figure: str, seconds: float, what: str = "") -> Figure:
        return Figure(benchmark=NAME, figure=figure, value=seconds / result.seconds, unit="fraction", note=what)

    return [
        Figure(benchmark=NAME, figure="rule steps/s", value=statistics.rules / result.seconds, unit="rules/s",
               target=at_least(2000), note=note),
        Figure(benchmark=NAME, figure="rule steps per CPU-second", value=statistics.rules / cpu_seconds,
               unit="rules/CPU-s", note=f"{cpu_seconds:.1f} CPU-s of this process"),
        Figure(benchmark=NAME, figure="engine steps compared/s", value=statistics.steps / result.seconds,
               unit="steps/s"),
        share("Hypothesis share", hypothesis, "rule selection, draws, preconditions, the state machine's code"),
        share("call handling share", calls, "the kit's: recording calls, validating answers, following the schedule"),
        share("checks share", statistics.checks_seconds),
        share("reference share", statistics.reference_seconds),
        share("adapter share", statistics.adapter_seconds),
    ]
