"""Benchmark 7: real connectors beside the reference (issue 39 item 3) — judged engine steps per second of the reference
adapter and of real vLLM connectors through `vllm-connector` (vLLM's OffloadingConnector by default; the NIXL pair
through `vllm-pd` where its wheels are installed), measured in one run, their ratio to the reference's, and where a
real connector's run spends its time.

The split is the run's own accounting (`runner.RunStatistics`: Hypothesis, the kit's call handling, the checks, the
reference, the adapter), the adapter's time divided by the vLLM adapters' own timers (`engine.VllmAdapter.seconds`:
vLLM's scheduler with the connector's scheduler side, the ranks' worker side); what is left of the adapter's time is
its observation. vLLM's import happens before the clock starts.
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

from kvconform.adapters.contract import KVConnectorAdapter
from kvconform.adapters.reference import ReferenceAdapter
from kvconform.adapters.vllm import runtime
from kvconform.adapters.vllm.engine import SCHEDULER, WORKERS
from kvconform.benchmarks.figures import Figure, Progress, at_least
from kvconform.conformance import runner

NAME = "connectors"


@dataclass(frozen=True)
class ConnectorsSettings:
    profile: str = "ci"
    connectors: tuple[str, ...] = ("OffloadingConnector",)
    """Connectors `vllm-connector` runs, by vLLM's factory name or module:Class."""


@dataclass(frozen=True)
class Measured:
    steps_per_second: float
    note: str
    shares: dict[str, float]


def add_adapter_seconds(total: defaultdict[str, float], adapter: KVConnectorAdapter) -> None:
    """Add a vLLM adapter's own timers (`VllmAdapter.seconds`) to `total`, a pair's engines' in this process."""
    for engine in getattr(adapter, "engines", {"engine": adapter}).values():
        for part, seconds in getattr(engine, "seconds", {}).items():
            total[part] += seconds


def _measure(factory: Callable[[], KVConnectorAdapter], name: str, profile: str) -> Measured:
    """Run `factory`'s adapter under `profile`; return its judged engine steps/s and how its run's time splits."""
    built: list[KVConnectorAdapter] = []

    def recorded() -> KVConnectorAdapter:
        built.append(factory())
        return built[-1]

    load = os.getloadavg()[0]
    result = runner.run(recorded, name, profile)
    statistics = result.statistics
    inside: defaultdict[str, float] = defaultdict(float)
    for adapter in built:
        add_adapter_seconds(inside, adapter)
    parts = {
        "Hypothesis": result.seconds - statistics.execution_seconds,
        "the kit's call handling": statistics.execution_seconds - statistics.adapter_seconds
        - statistics.reference_seconds - statistics.checks_seconds,
        "checks": statistics.checks_seconds,
        "reference": statistics.reference_seconds,
        SCHEDULER: inside[SCHEDULER],
        WORKERS: inside[WORKERS],
        "the adapter's observation": statistics.adapter_seconds - inside[SCHEDULER] - inside[WORKERS],
    }
    note = (f"{statistics.steps:,} engine steps in {result.seconds:.1f} s, profile {profile}, load average "
            f"{load:.2f} → {os.getloadavg()[0]:.2f}" + ("" if result.passed else f"; FAILED {result.failed_clause}"))
    return Measured(statistics.steps / result.seconds, note,
                    {part: seconds / result.seconds for part, seconds in parts.items()})


def measure(settings: ConnectorsSettings, progress: Progress) -> list[Figure]:
    """Return the reference's judged engine steps/s, each connector's and its ratio to the reference's, and the split
    of each connector's run."""
    progress(f"{NAME}: reference adapter, profile {settings.profile}")
    reference = _measure(ReferenceAdapter, "reference", settings.profile)
    figures = [Figure(benchmark=NAME, figure="reference steps/s", value=reference.steps_per_second, unit="steps/s",
                      note=reference.note)]
    if runtime.installed_version() is None:
        return figures + [Figure(benchmark=NAME, figure=f"{spec} steps/s", value=None, unit="steps/s",
                                 note="not measured: vLLM is not installed (kvconform install-vllm 0.24.0)")
                          for spec in settings.connectors]
    runtime.load()  # vLLM's import, before any clock
    from kvconform.adapters.vllm.connector import CONNECTOR, VllmConnectorAdapter
    from kvconform.adapters.vllm.pd import DEFAULT_CONNECTOR, INSTALL, VllmPDAdapter

    runs: list[tuple[str, str, str, Callable[[], KVConnectorAdapter]]] = [
        (spec, spec, "vllm-connector", VllmConnectorAdapter) for spec in settings.connectors]
    if importlib.util.find_spec("nixl") is None:
        figures.append(Figure(benchmark=NAME, figure=f"{DEFAULT_CONNECTOR} pair steps/s", value=None, unit="steps/s",
                              note=f"not measured: the NIXL wheels are not installed here ({INSTALL}, then "
                                   "kvconform bench in that environment)"))
    else:
        runs.append((f"{DEFAULT_CONNECTOR} pair", DEFAULT_CONNECTOR, "vllm-pd", VllmPDAdapter))
    for label, spec, adapter, factory in runs:
        progress(f"{NAME}: {adapter} {spec}, profile {settings.profile}")
        with mock.patch.dict(os.environ, {CONNECTOR: spec}):  # the connector vllm-connector builds, for this run
            measured = _measure(factory, adapter, settings.profile)
        figures += [
            Figure(benchmark=NAME, figure=f"{label} steps/s", value=measured.steps_per_second, unit="steps/s",
                   note=f"{adapter}, vLLM {runtime.installed_version()}: {measured.note}"),
            Figure(benchmark=NAME, figure=f"{label} / reference", value=measured.steps_per_second
                   / reference.steps_per_second, unit="ratio", target=at_least(0.7),
                   note="judged engine steps/s, the connector's over the reference's, in this run"),
            *(Figure(benchmark=NAME, figure=f"{label}: {part}", value=share, unit="fraction",
                     note="share of the run's wall time") for part, share in measured.shares.items()),
        ]
    return figures
