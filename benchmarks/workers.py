"""Benchmark 5: a campaign across cores, as `pytest -n N` runs it — the state machine's examples per second and the
time to kill the whole mutant catalogue, with each number of workers, in one benchmark run.

Each count of workers runs in a pytest process of its own, started afresh; the speed-ups are the rates at the most
workers over the rates at the fewest. Each figure's note says how many cores the run got (the CPU seconds of the
pytest process and its workers over the wall-clock seconds): on a machine other processes share, a speed-up short of
the workers ratio with fewer cores than workers is the machine's, not the kit's.

The catalogue's mutants take from a fraction of a second to half a minute each (`ci`), so its tests are spread by
work stealing (`--dist worksteal`): a worker that runs out takes tests queued for the other, rather than idling
while the other works through its queue.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconform.benchmarks import catalogue_suite
from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.conformance.campaign import isolated
from kvconform.conformance.mutants import MUTANTS

NAME = "workers"
STATE_MACHINE = ["--pyargs", "kvconform.suite::test_state_machine"]
"""The state machine of the pytest plugin's suite, as a user's `pytest -n N --kv-adapter=…` runs it."""


@dataclass(frozen=True)
class WorkersSettings:
    workers: tuple[int, ...] = (1, 2)
    profile: str = "dev"
    """The profile of the state-machine runs, reference adapter against the reference model."""
    seed: int = 0
    catalogue_profile: str = "ci"
    mutants: tuple[str, ...] = tuple(MUTANTS)


@dataclass(frozen=True)
class PytestRun:
    seconds: float
    cpu_seconds: float
    """CPU time of the pytest process and its workers."""
    passed: bool
    report: dict[str, Any]
    """The kvconform report the run wrote; empty for a run that writes none (the catalogue's)."""

    @property
    def cores(self) -> str:
        return f"{self.cpu_seconds / self.seconds:.2f} cores used"


XDIST_MISSING = "not measured: pytest-xdist is not installed (pip install -e '.[xdist]')"


def measure(settings: WorkersSettings, progress: Progress) -> list[Figure]:
    """Return examples/s and the catalogue's time to kill per count of workers, and the speed-up of each; without
    pytest-xdist, the speed-ups unmeasured, saying why."""
    fewest, most = min(settings.workers), max(settings.workers)
    if importlib.util.find_spec("xdist") is None:
        progress(f"{NAME}: {XDIST_MISSING}")
        return [Figure(benchmark=NAME, figure=f"{what} speed-up, {most} / {fewest} workers", value=None, unit="ratio",
                       target=at_least(0.9 * most / fewest), note=XDIST_MISSING)
                for what in ("state machine", "mutant catalogue")]
    rates, kills = {}, {}
    for workers in settings.workers:
        progress(f"{NAME}: state machine, reference adapter, profile {settings.profile}, {workers} worker(s)")
        run = _state_machine(settings, workers)
        parts = [part["seconds"] for part in run.report["shards"]]
        rules = sum(part["statistics"]["rules"] for part in run.report["shards"])
        examples = run.report["statistics"]["examples"]
        rates[workers] = (examples / max(parts), rules / max(parts),
                          f"{examples} examples of {rules:,} rule steps, parts of "
                          f"{' / '.join(f'{part:.1f}' for part in parts)} s, {run.seconds:.1f} s with the workers' "
                          f"start, {run.cores}")
    for workers in settings.workers:
        progress(f"{NAME}: {len(settings.mutants)} mutants, profile {settings.catalogue_profile}, {workers} worker(s)")
        run = _catalogue(settings, workers)
        kills[workers] = (run.seconds, ("every mutant killed" if run.passed else "NOT every mutant was killed")
                          + f", {run.cores}")
    figures = [Figure(benchmark=NAME, figure=f"state machine examples/s, {workers} worker(s)", value=rate,
                      unit="examples/s", note=note) for workers, (rate, _, note) in rates.items()]
    figures.append(Figure(benchmark=NAME, figure=f"state machine speed-up, {most} / {fewest} workers",
                          value=rates[most][1] / rates[fewest][1], unit="ratio", target=at_least(0.9 * most / fewest),
                          note="rule steps/s over the longest part's time: each worker draws programs of its own "
                               "seed, whose examples differ in length"))
    figures += [Figure(benchmark=NAME, figure=f"mutant catalogue time to kill, {workers} worker(s)", value=seconds,
                       unit="s", note=note) for workers, (seconds, note) in kills.items()]
    figures.append(Figure(benchmark=NAME, figure=f"mutant catalogue speed-up, {most} / {fewest} workers",
                          value=kills[fewest][0] / kills[most][0], unit="ratio", target=at_least(0.9 * most / fewest),
                          note=f"{len(settings.mutants)} mutants, profile {settings.catalogue_profile}, wall-clock "
                               "with the workers' start"))
    return figures


def _state_machine(settings: WorkersSettings, workers: int) -> PytestRun:
    with tempfile.TemporaryDirectory(prefix="kvconform-bench-") as folder:
        path = Path(folder) / "run.json"
        run = _pytest(Path(folder), workers, [*STATE_MACHINE, "--kv-adapter=reference",
                                              f"--kv-profile={settings.profile}", f"--kv-seed={settings.seed}",
                                              "--kv-database=none", f"--kv-report={path}"], {})
        if not path.exists():
            raise RuntimeError(f"the state-machine run with {workers} worker(s) wrote no report")
        return PytestRun(run.seconds, run.cpu_seconds, run.passed, json.loads(path.read_text()))


def _catalogue(settings: WorkersSettings, workers: int) -> PytestRun:
    with tempfile.TemporaryDirectory(prefix="kvconform-bench-") as folder:
        return _pytest(Path(folder), workers, ["--dist", "worksteal", catalogue_suite.__file__],
                       {catalogue_suite.PROFILE_VARIABLE: settings.catalogue_profile,
                        catalogue_suite.MUTANTS_VARIABLE: ",".join(settings.mutants)})


def _pytest(folder: Path, workers: int, arguments: list[str], environment: dict[str, str]) -> PytestRun:
    """Run pytest under `workers` xdist workers in a process of its own; return its wall-clock and CPU time and
    verdict."""
    started, cpu_started = time.perf_counter(), _children_cpu_seconds()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(workers), *isolated(folder), *arguments],
                          capture_output=True, text=True, cwd=folder, env={**os.environ, **environment})
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest with {workers} worker(s) ended with status {done.returncode}: "
                           f"{done.stdout[-2000:]}")
    return PytestRun(time.perf_counter() - started, _children_cpu_seconds() - cpu_started, done.returncode == 0, {})


def _children_cpu_seconds() -> float:
    """Return the CPU time of the child processes that ended so far, theirs included (the workers of a pytest run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
