"""Benchmark 2: time to counterexample, each catalogue mutant run over several seeds until it fails."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from kvconform.benchmarks.figures import Figure, Progress, at_least, at_most
from kvconform.conformance import runner
from kvconform.conformance.mutants import MUTANTS

NAME = "counterexample"


@dataclass(frozen=True)
class CounterexampleSettings:
    profile: str = "dev"
    seeds: int = 10
    mutants: tuple[str, ...] = tuple(MUTANTS)


def measure(settings: CounterexampleSettings, progress: Progress) -> list[Figure]:
    """Return, per mutant, the median and max seconds until the run fails, the shrunk length and the clause hit rate."""
    figures = []
    for name in settings.mutants:
        row = MUTANTS[name]
        results = []
        for seed in range(settings.seeds):
            result = runner.run(row.adapter, name, settings.profile, seed=seed)
            progress(f"{NAME}: {name} seed {seed}: "
                     f"{'passed' if result.passed else result.failed_clause} after {result.seconds:.1f} s")
            results.append(result)
        figures += _mutant_figures(name, row.clauses, results, settings.profile)
    return figures


def _mutant_figures(name: str, clauses: tuple[str, ...], results: list[runner.RunResult], profile: str) -> list[Figure]:
    failed = [result for result in results if not result.passed]
    outcomes = Counter("passed" if result.passed else result.failed_clause for result in results)
    seeds_note = f"{len(results)} seeds, profile {profile}: " + ", ".join(f"{k} ×{n}" for k, n in outcomes.items())
    seconds = [result.seconds for result in failed]
    found = [result.found_after for result in failed if result.found_after is not None]
    shrunk = [result.counterexample_requests for result in failed]
    missing = "" if failed else "no seed failed"
    return [
        Figure(benchmark=NAME, figure=f"{name}: seeds failing {' or '.join(clauses)}",
               value=sum(outcomes[clause] for clause in clauses) / len(results), unit="fraction",
               target=at_least(1.0), note=seeds_note),
        Figure(benchmark=NAME, figure=f"{name}: median time to failure",
               value=statistics.median(seconds) if failed else None, unit="s", target=at_most(10),
               note=(f"shrinking included; found after {statistics.median(found):.1f} s (median)" if failed
                     else missing)),
        Figure(benchmark=NAME, figure=f"{name}: max time to failure", value=max(seconds, default=None), unit="s",
               note=missing),
        Figure(benchmark=NAME, figure=f"{name}: shrunk length (max)", value=max(shrunk, default=None),
               unit="requests", target=at_most(3),
               note=f"median {statistics.median(shrunk):g}" if failed else missing),
    ]
