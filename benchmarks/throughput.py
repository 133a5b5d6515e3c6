"""Benchmark 1: harness throughput, the reference adapter run against the reference model."""

from __future__ import annotations

from dataclasses import dataclass

from kvconform.adapters.reference import ReferenceAdapter
from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.conformance import runner

NAME = "throughput"


@dataclass(frozen=True)
class ThroughputSettings:
    profile: str = "ci"


def measure(settings: ThroughputSettings, progress: Progress) -> list[Figure]:
    """Return rule steps and compared engine steps per second, and how the run's time splits between the harness
    (Hypothesis's rule selection and draws, call recording), the checks, the reference and the adapter."""
    progress(f"{NAME}: reference adapter, profile {settings.profile}")
    result = runner.run(ReferenceAdapter, "reference", settings.profile)
    harness = result.seconds - result.adapter_seconds - result.reference_seconds - result.checks_seconds
    note = (f"{result.rules:,} rules and {result.steps:,} engine steps in {result.seconds:.1f} s, "
            f"profile {settings.profile}")
    if not result.passed:
        note += f"; the run FAILED {result.failed_clause}"
    return [
        Figure(benchmark=NAME, figure="rule steps/s", value=result.rules / result.seconds, unit="rules/s",
               target=at_least(2000), note=note),
        Figure(benchmark=NAME, figure="engine steps compared/s", value=result.steps / result.seconds, unit="steps/s"),
        Figure(benchmark=NAME, figure="harness share", value=harness / result.seconds, unit="fraction",
               note="Hypothesis's rule selection and draws, call recording"),
        Figure(benchmark=NAME, figure="checks share", value=result.checks_seconds / result.seconds, unit="fraction"),
        Figure(benchmark=NAME, figure="reference share", value=result.reference_seconds / result.seconds,
               unit="fraction"),
        Figure(benchmark=NAME, figure="adapter share", value=result.adapter_seconds / result.seconds,
               unit="fraction"),
    ]
