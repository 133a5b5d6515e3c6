"""Benchmark 8: what recording a trace costs and how fast one is checked (issue 38 item 2) — a reference run without a
trace, the same run recording one (`--record-trace`), and `kvconform check` of that trace, measured in one benchmark
run: the time per engine step of each, the recorder's overhead as their ratio, the trace's bytes per step, and whether
the check reached the live verdict.

The runs alternate, `repetitions` times, in turn first and second (a run after another is slowed by what the other
left behind), and each figure is the fastest of its repetitions: on a machine other processes share, the fastest is
the one they slowed least, so the ratio compares like with like.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.conformance import options
from kvconform.conformance.report import RunReport

NAME = "traces"


@dataclass(frozen=True)
class TracesSettings:
    profile: str = "smoke"
    adapter: str = "reference"
    repetitions: int = 5


def per_step(run_report: RunReport) -> float:
    """Return a run's microseconds per judged engine step."""
    return run_report.seconds / max(run_report.statistics.steps, 1) * 1e6


def measure(settings: TracesSettings, progress: Progress) -> list[Figure]:
    """Return µs/step without and with the recorder and for the check, the overhead ratio, bytes/step, and the check's
    agreement with the live verdict."""
    load = os.getloadavg()[0]
    plain: list[RunReport] = []
    recorded: list[RunReport] = []
    checked: list[RunReport] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.jsonl"
        for repetition in range(settings.repetitions):
            progress(f"{NAME}: {settings.adapter}, profile {settings.profile}, without a trace and recording one "
                     f"({repetition + 1} of {settings.repetitions})")
            for trace_path in (None, path) if repetition % 2 == 0 else (path, None):
                run = options.run(options.prepare(settings.adapter, profile=settings.profile, database="none",
                                                  record_trace=trace_path))
                (plain if trace_path is None else recorded).append(run)
            checked.append(options.check(path))
        size = path.stat().st_size
    fastest = {name: min(map(per_step, runs)) for name, runs in
               (("plain", plain), ("recorded", recorded), ("checked", checked))}
    steps = recorded[-1].statistics.steps
    note = (f"fastest of {settings.repetitions}; {steps:,} steps, {recorded[-1].statistics.examples} examples, "
            f"profile {settings.profile}, load average {load:.2f} → {os.getloadavg()[0]:.2f}")
    agreeing = sum((live.failed_clause, live.clauses, live.exercise, live.statistics.steps) ==
                   (check.failed_clause, check.clauses, check.exercise, check.statistics.steps)
                   for live, check in zip(recorded, checked, strict=True))
    return [
        Figure(benchmark=NAME, figure="run without a trace", value=fastest["plain"], unit="µs/step", note=note),
        Figure(benchmark=NAME, figure="run recording its trace", value=fastest["recorded"], unit="µs/step"),
        Figure(benchmark=NAME, figure="recorder overhead (recording / plain)",
               value=fastest["recorded"] / fastest["plain"], unit="ratio"),
        Figure(benchmark=NAME, figure="trace size per step", value=size / max(steps, 1), unit="bytes/step",
               note=f"{size:,} bytes in all"),
        Figure(benchmark=NAME, figure="kvconform check of the trace", value=fastest["checked"], unit="µs/step"),
        Figure(benchmark=NAME, figure="checks reaching the live verdict", value=agreeing / settings.repetitions,
               unit="fraction", target=at_least(1.0)),
    ]
