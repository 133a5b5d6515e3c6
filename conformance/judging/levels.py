"""The spec levels' judges, one row per level (chapter `conformance`): importing this module registers every check.

A new level is a module of this folder (a judge built from the run and the engine's config, and the checks it runs)
and one row of `JUDGES`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvconform.common.values import Capabilities, EngineConfig, SpecLevel
from kvconform.conformance.judging.connector import ConnectorJudge
from kvconform.conformance.judging.disaggregated import DisaggregatedJudge
from kvconform.conformance.judging.events import EventsJudge
from kvconform.conformance.judging.judge import CHECKS, Judge, Run
from kvconform.conformance.judging.offloading import OffloadingJudge

JUDGES: dict[SpecLevel, Callable[[Run, EngineConfig], Judge]] = {
    "disaggregated": DisaggregatedJudge, "offloading": OffloadingJudge, "connector": ConnectorJudge,
    "events": EventsJudge}
"""Each spec level's judge, the deeper level first: a failure it finds names the block and the cause; the events
level's last, as what a router is told follows from what the engine did."""


def judged_levels(capabilities: Capabilities) -> set[SpecLevel]:
    """Return the levels an adapter is judged at: those it reports, and the connector level, which every connector
    meets (chapter `connector-level`); a producer/consumer pair is judged at the disaggregated level alone, as it is
    not one engine (chapter `disaggregated`)."""
    if "disaggregated" in capabilities.levels:
        return {"disaggregated"}
    return {"connector", *capabilities.levels}


def judges_for(run: Run, config: EngineConfig) -> list[Judge]:
    """Return the judges of an execution: one per level its adapter is judged at, the deeper level first."""
    levels = judged_levels(run.capabilities)
    return [judge(run, config) for level, judge in JUDGES.items() if level in levels]


def run_time_clauses() -> set[str]:
    """Return the clauses judged against an adapter at run time: those a registered check is registered for."""
    return {clause for each in CHECKS.values() for clause in each.clauses}
